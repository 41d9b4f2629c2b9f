"""llm.c's GPT-2 pieces: the encoder (token + position embedding) and the linear layer's bias
gradient. Kernels: encoder.py (and ../reduce.py's bias_grad). Ops: launch.py (the launches),
op.py (`kbuild.encoder`, `kbuild.bias_grad`, `kbuild.linear`).
"""
