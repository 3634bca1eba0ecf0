"""SGLang's startup, readiness and liveness probe in the inference pod: GET /health_generate on the pod's loopback.

/health_generate runs a real one-token generation, so success means the model answers, not only that the HTTP
server is up. Exit 0 on a 200, 1 otherwise (the kubelet counts failures; inference.yaml sets how many).
"""

import sys
import urllib.request

try:
    with urllib.request.urlopen("http://127.0.0.1:30000/health_generate", timeout=80) as resp:
        sys.exit(0 if resp.status == 200 else 1)
except OSError as exc:
    print(f"/health_generate: {exc}", file=sys.stderr)
    sys.exit(1)
