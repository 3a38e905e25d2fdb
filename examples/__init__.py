"""Ports of the peers' own Omniglot MAML examples to maml-toolkit (docs/porting.md); not installed with the wheel.

python -m examples.learn2learn_omniglot    # learn2learn's examples/vision/maml_omniglot.py
python -m examples.higher_omniglot         # higher's examples/maml-omniglot.py
python -m examples.torchopt_omniglot       # TorchOpt's examples/few-shot/maml_omniglot.py
"""
