"""Plugin API 2 path of ``lowlat.errors``: deprecated, goes away in lowlat 0.4.

Import the errors from lowlat.plugin instead.
"""

import sys
import warnings

import lowlat.errors as _moved

warnings.warn("lowlat.plugin.errors moved to lowlat.errors: import the errors from lowlat.plugin "
              "(the API 2 path goes away in lowlat 0.4)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
