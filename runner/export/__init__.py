"""`vmoe export`: a vmoe model as a PyTorch model folder (model.safetensors, config.json and a
readable modeling_vmoe.py that imports only torch, safetensors and the standard library).
`modeling_vmoe.py` is the template that `files` copies as text: vmoe never imports torch."""
