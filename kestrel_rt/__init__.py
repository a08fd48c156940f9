"""kestrel_rt: the runtime. Qwen3 models in torch, one backend instance per model."""
