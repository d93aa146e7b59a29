"""``python -m mpirt.data``: prepare and inspect token datasets (:mod:`mpirt.data.tokens`)."""
import sys

from mpirt.data import tokens

sys.exit(tokens.main())
