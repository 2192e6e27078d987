"""The worker process: one MLX model, its caches and its generation loop. The only package that imports MLX."""
