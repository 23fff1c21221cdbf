"""Plugin API 2 path of ``lowlat.kv_cache``: deprecated, goes away in lowlat 0.4.

Import KVPool from lowlat.plugin instead.
"""

import sys
import warnings

import lowlat.kv_cache as _moved

warnings.warn("lowlat.runtime.kv_cache moved to lowlat.kv_cache: import KVPool from lowlat.plugin "
              "(the API 2 path goes away in lowlat 0.4)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
