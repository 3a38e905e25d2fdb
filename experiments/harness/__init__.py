"""What the fit scripts (``experiments.sine``, ``.omniglot``, ``.images``) share, one module per story.

:mod:`~experiments.harness.fit` runs an :class:`~experiments.harness.fit.Experiment` from the command line to
``results.json``; :class:`~experiments.harness.lifecycle.Lifecycle` turns how the run ends into one line and an exit code
(:mod:`~experiments.harness.folder`). docs/experiments.md ("Where the code is") names every module.
"""
