"""casnap where checkpoints are taken today: adapters over the public API.

Each module wraps one outside library and imports it only when used, so
``import casnap`` never needs the extras:

- ``casnap.integrations.dcp``: torch.distributed.checkpoint storage writer and reader;
- ``casnap.integrations.importers``: DCP directories, safetensors files, Hugging
  Face model directories and ``torch.save`` files into a repository;
- ``casnap.integrations.lightning``: a Lightning ``CheckpointIO`` plugin (extra ``lightning``);
- ``casnap.integrations.hf``: a Hugging Face ``Trainer`` callback (extra ``hf``);
- ``casnap.integrations.torchtitan``: a torchtitan checkpoint manager (extra ``torchtitan``).

This layer sits above ``casnap.api`` and below ``casnap.cli`` (pyproject.toml,
``[tool.importlinter]``).
"""
