"""The only code in the worker that calls MLX: the engine (model + BatchGenerator), the KV blocks and
prompt caches built from its cache state, and the random-weight model maker. Everything else in
worker/ (the loop, the orderly exit, text streams, the SSD file format) runs without MLX."""
