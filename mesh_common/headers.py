"""The HTTP headers (gRPC metadata keys) the mesh's parts send one another, in one place.

The Wasm filters (Zig) and the dashboard (JS) spell the same names; the Python that builds the
routes that set them, the runtime that reads them and the callers that send them use these.
"""

# Set by the sidecar's authz filter alone, after it verified the caller; inbound listeners drop
# client-sent ones before any filter.
TENANT_HEADER = "x-meshlm-tenant"
PRIORITY_HEADER = "x-meshlm-priority"
PRINCIPAL_HEADER = "x-meshlm-principal"  # the caller's SPIFFE ID, from its mTLS certificate
# The tenant's token budget on this sidecar (model_runtime/serving/budgets.py):
# `tokens_per_minute=N;tokens_per_day=M`.
TOKEN_BUDGET_HEADER = "x-meshlm-token-budget"
IDENTITY_HEADERS = (TENANT_HEADER, PRIORITY_HEADER, PRINCIPAL_HEADER, TOKEN_BUDGET_HEADER)

# The caller's credential (Envoy's api_key_auth and the authz filter read it).
API_KEY_HEADER = "x-api-key"

# The request class (a hash of the request, never its text), set by the caller-side sidecar;
# isolation routes and the SLO loop's access log key on it.
CLASS_HEADER = "x-meshlm-class"

# The prompt-prefix key (a hash of the prompt's leading blocks, never its text), set by the
# caller-side sidecar; `load_balancing: prefix_aware` routes hash on it.
PREFIX_HEADER = "x-meshlm-prefix"

# Pins a call to a version: `always` (the canary) or `never` (the stable). A service's route may
# name another header (mesh file `route.canary_header`); this is the default.
CANARY_HEADER = "x-canary"

# The quality gate's mirroring: a caller marks a call safe to copy to the canary (greedy, no side
# effects); only the canary's inbound sidecar sets SHADOW_HEADER on a copy toward its runtime.
MIRROR_HEADER = "x-meshlm-mirror"
MIRROR_SAFE = "safe"
SHADOW_HEADER = "x-meshlm-shadow"  # "1": a mirrored copy
REQUEST_ID_HEADER = "x-request-id"  # Envoy's; a mirror's shadow keeps the original's

# Stall resume: the runtime names the replica serving a stream (a resume avoids it); the
# caller-side route says which version served and the service's stall policy, and a resume's
# request pins that version.
REPLICA_HEADER = "x-meshlm-replica"
VERSION_HEADER = "x-meshlm-version"
STALL_HEADER = "x-meshlm-stall"

# With a stream's first chunk: the prompt's length in tokens.
PROMPT_TOKENS_HEADER = "x-meshlm-prompt-tokens"

# Envoy's XFCC: the verified client certificate of the mTLS hop, set by the callee's sidecar.
CLIENT_CERT_HEADER = "x-forwarded-client-cert"

# The model a request names (OpenAI JSON `model`, GenerateRequest.model), set by the caller-side
# sidecar's classify filter for a well-formed name only; routes of a Host that names no service
# pick the service by it. A client-sent copy is removed.
MODEL_HEADER = "x-meshlm-model"
