"""Plugin API 2 path of a host-side module (``lowlat.plugin._compat.MODULES`` names its new home).

Deprecated: it warns on import and goes away in lowlat 0.4.
"""

import sys

from lowlat.plugin._compat import moved_module

sys.modules[__name__] = moved_module(__name__)
