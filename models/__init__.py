"""Model families (one file per family), Hugging Face config mapping, safetensors loader,
architecture registry and the embedded tiny checkpoints.

Entry point: ``models.loader.load_model(model_dir, dtype, device) -> (model, ModelConfig)``.
Kept free of eager imports so importing a submodule never drags in the rest.
"""
