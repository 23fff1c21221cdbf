"""Plugin API 2 path of ``lowlat.forward_batch``: deprecated, goes away in lowlat 0.4.

Import ForwardBatch and ForwardMode from lowlat.plugin instead.
"""

import sys
import warnings

import lowlat.forward_batch as _moved

warnings.warn("lowlat.runtime.forward_batch moved to lowlat.forward_batch: "
              "import ForwardBatch and ForwardMode from lowlat.plugin (the API 2 path goes away in lowlat 0.4)",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
