"""Build-machine tools for installing edgefl on ARM gateways (not shipped in the edgefl wheel).

Each file's job: ``cross_build/README.md``.
"""
