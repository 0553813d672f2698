"""The commands behind `make userdata` and `make monitoring` (`python -m infra.cli.<name>`).

Library modules (infra/userdata.py, infra/monitoring.py) render; the commands here read the
stack file, call them, write files and turn user errors into exit code 2.
"""
