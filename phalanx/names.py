"""The one rule for names people choose and other names are built from: nodes, jobs, certificates.

1-63 letters, digits, '.', '_' or '-', starting with a letter or digit: safe in paths, hostnames,
metric labels and certificate subjects (never ',' or '=', which controller/auth relies on).
"""

import re

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
RULE = "1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
