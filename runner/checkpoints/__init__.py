"""Checkpoints: our own, written and read through Orbax (`checkpoint`); the weights a stage starts
from (`weights`); the released V-MoE checkpoints' format (`vmoe_format`) and names (`mapping`);
timm's and transformers' ViTs (`pytorch_formats`: their files, `state_dicts`; their names,
`timm_format`, `transformers_format`, what both share, `pytorch_vit`)."""
