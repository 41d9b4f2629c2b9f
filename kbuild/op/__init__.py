"""How an op is declared and launched (torch's side; no MLIR): `Op` and what it takes and gives
(opdef.py, args.py), how a kernel launch binds to an op's call (binding.py), the launch shapes
and launchers every op shares (launch.py), what every op does with its tensors (tensors.py),
and the C++ hot path's one call into Python (resolve.py). The op families themselves live in
kbuild/kernels/<family>/.
"""
