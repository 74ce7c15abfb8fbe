"""`vmoe export`: a vmoe model as a PyTorch model folder (model.safetensors, config.json and a
readable modeling_vmoe.py that imports only torch, safetensors and the standard library).

- `modeling_vmoe.py`: the template of the exported modeling file (text that `files` copies; no
  module of vmoe imports it, and vmoe never imports torch);
- `architecture`: config.json from a model config, and what the exporter cannot express;
- `layout`: the Flax parameters under the PyTorch module's names and layouts;
- `files`: writes the folder.
"""
