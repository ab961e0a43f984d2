"""Framework adapters: plain PyTorch, DeepSpeed, Megatron-Core (installed as entrain_data.adapters)."""
