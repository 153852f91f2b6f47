"""Models: where a model comes from (catalogue, folder, GGUF file, live object), its rope schedule, tiny configs."""
