"""Build-machine tools for installing edgefl on ARM gateways (not shipped in the edgefl wheel).

``wheelhouse.py`` builds an offline wheelhouse per target platform (``targets.py``: the platforms;
``lock.py``: the closure check and the lock file), ``install.sh`` installs one on a
gateway, ``edgefl-agent.service`` is the systemd unit template, ``check_emulated.sh`` proves a
wheelhouse installs and classifies correctly under emulation.
"""
