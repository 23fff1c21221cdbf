"""Plugin API 2 path of ``lowlat.distributed``: deprecated, goes away in lowlat 0.4.

Import lowlat.distributed instead.
"""

import sys
import warnings

import lowlat.distributed as _moved

warnings.warn("lowlat.runtime.distributed moved to lowlat.distributed: import lowlat.distributed "
              "(the API 2 path goes away in lowlat 0.4)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
