"""Checkpoints: our own, written and read through Orbax (`checkpoint`); the weights a stage starts
from (`weights`); the released V-MoE checkpoints' format (`vmoe_format`) and names (`mapping`)."""
