"""Checkpoint formats: the files of a drafter folder and the public (Hugging Face) layouts other
tools read and write.

- `files`: config.json, the weights (model.safetensors, its sharded form, pytorch_model.bin) with
  tensor names and shapes from the safetensors headers, an atomic save; SharpDraft's own layout
  (`drafters.base.Drafter.save` / `load`) uses it too.
- `public`: the one load / save / check every public format shares (`PublicFormat`), and the
  config.json fields they read alike.
- one module per public format, holding only what differs: `zlab_dflash` (z-lab DFlash),
  `specforge_eagle3` (SafeAILab / SpecForge EAGLE-3), `amd_pard` (AMD PARD). The drafters that
  run them are `drafters.zlab_dflash`, `drafters.specforge_eagle3` and `drafters.amd_pard`.
"""
