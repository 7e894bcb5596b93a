"""Optional framework integrations; import the one you use (each needs its framework installed).

    from trainmedic.client.integrations.transformers import TrainMedicCallback   # Hugging Face Trainer
    from trainmedic.client.integrations.lightning import TrainMedicCallback      # PyTorch Lightning

This package imports neither framework itself, so `import trainmedic.client` stays light.
"""
from __future__ import annotations
