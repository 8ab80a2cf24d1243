"""The PyTorch side: models from presets or local HuggingFace directories, their example inputs,
the torch side of packed attention, and the importer's conversions. May import core and deploy."""
