"""Plugin API 2 path of ``lowlat.layers.weights``: deprecated, goes away in lowlat 0.4.

Import lowlat.layers.weights instead.
"""

import sys
import warnings

import lowlat.layers.weights as _moved

warnings.warn("lowlat.models.weights moved to lowlat.layers.weights: import lowlat.layers.weights "
              "(the API 2 path goes away in lowlat 0.4)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
