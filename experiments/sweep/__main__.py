"""``python -m experiments.sweep``: the sweep runner's command line (:func:`experiments.sweep.main`)."""

import signal
import sys

from experiments.sweep import main

if __name__ == "__main__":
    # Ctrl-C and SIGTERM (``kill``, a cluster's pre-emption) stop the sweep by KeyboardInterrupt: trials stopped,
    # resumable; SIGINT too when inherited as ignored (a shell's background job), as the trials must be stopped.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
