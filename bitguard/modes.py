"""Recording modes: what each observes. Shared by the recorder (collectors/hooks.py) and the
comparison (a full-mode run compared with a trusted-mode one), so the two never disagree."""

import re

MODES = ("full", "trusted", "online")  # full: every module call; trusted: heavy modules only (cheaper);
# online: no boundary events, sensors for silent data corruption and alerts (collectors/online/)

# Trusted mode observes only module calls of these types (and gradients, optimizer steps, data).
HEAVY_MODULES = re.compile(r"Linear|Embedding|Norm|Attention|Attn|MoE|Router|Expert|Conv", re.IGNORECASE)
