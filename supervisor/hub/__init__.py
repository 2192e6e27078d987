"""Getting models: pulling them from the Hugging Face hub into its cache (pull.py), the cache's models as the
daemon and `mlxsup ls`/`rm` see them (store.py), and which architectures an MLX worker can load (arch.py).

Imports huggingface_hub, never mlx: the supervisor stays free of the worker's imports.
"""
