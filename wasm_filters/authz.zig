//! meshlm authz: a proxy-wasm HTTP filter written against the ABI 0.2.1 directly.
//!
//! Per request: with `callers`, the caller's SPIFFE ID (the URI SAN of its verified mTLS
//! certificate, property `connection.uri_san_peer_certificate`) -> the first rule naming it ->
//! its allowed paths, before any key is looked at; then API key (`x-api-key` or
//! `authorization: Bearer`) -> SHA-256 -> tenant (constant time compare; keys the policy already matched are remembered, see KnownKeys) -> allow rules
//! for this service's gRPC methods (an OpenAI HTTP path counts as the method it runs; any other
//! path is denied) -> per-tenant token bucket in
//! shared data (compare-and-swap) -> verified `x-meshlm-tenant` / `x-meshlm-priority` headers,
//! and `x-meshlm-principal` (the caller's SPIFFE ID) when `peer_identity` is on, and the
//! tenant's token budget share `x-meshlm-token-budget` (the runtime reserves from it).
//! A mirrored copy (`:authority` suffixed `-shadow` by Envoy's request mirroring) is
//! checked exactly the same but takes no token: the tenant's call was charged once where it was
//! served, and the route's mirror percent bounds the copies.
//! Host calls are most of the cost, so an allowed request makes few: one header read, one
//! bucket write, three header changes and a counter.
//! The configuration is JSON compiled by `wasm_filters/policy.py`; it holds key hashes only.
//! A denial answers gRPC callers with a grpc-status, any other caller with OpenAI's error JSON.
//! Fails closed: a bad configuration is refused in proxy_on_configure (Envoy NACKs it) and a
//! stream without a loaded policy is denied.
//! Build: `python -m wasm_filters.build` (zig from PyPI `ziglang`).

const std = @import("std");
const Sha256 = std.crypto.hash.sha2.Sha256;

const abi = @import("proxy_wasm.zig");
const OK = abi.OK;
const CONTINUE = abi.CONTINUE;
const STOP_ITERATION = abi.STOP_ITERATION;
const bump = abi.bump;
const log = abi.log;
const metric = abi.metric;
const scratch = &abi.scratch;

const gpa = std.heap.wasm_allocator;

// ---- configuration (the JSON compiled by policy.py) ----
const RateLimitJson = struct { max_tokens: u64, tokens_per_fill: u64, fill_interval_ms: u64 };
const TenantJson = struct {
    name: []const u8,
    priority: []const u8,
    key_sha256: []const []const u8,
    allow: []const []const u8,
    rate_limit: ?RateLimitJson = null,
    // `x-meshlm-token-budget` for the runtime, which reserves each call's tokens from it.
    token_budget: ?[]const u8 = null,
};
/// A workload that may call (`callers`): `principal` is a SPIFFE ID, or a prefix of IDs ending
/// in `*`; `paths` the request paths it may ask for, null for any.
const CallerJson = struct {
    name: []const u8,
    principal: []const u8,
    paths: ?[]const []const u8 = null,
};
/// An OpenAI HTTP path and the gRPC method it counts as; `/*` at the end matches one
/// more path segment.
const HttpPathJson = struct { path: []const u8, method: []const u8 };
const ConfigJson = struct {
    version: u32,
    service: []const u8,
    method_prefix: []const u8,
    http_paths: []const HttpPathJson = &.{},
    tenants: []const TenantJson,
    peer_identity: bool = false,
    /// null: any workload may call; empty: none.
    callers: ?[]const CallerJson = null,
};

const Tenant = struct {
    json: TenantJson,
    keys: []const [32]u8,
    bucket_key: []const u8,
    m_allowed: u32 = 0,
    m_forbidden: u32 = 0,
    m_limited: u32 = 0,
    m_shadow: u32 = 0,
    /// The bucket this VM last wrote (see takeToken); per policy, so a new one starts empty.
    written: ?Written = null,
};
const Written = struct { bucket: Bucket, cas: u32, at_ns: u64 };
const Caller = struct { json: CallerJson, m_allowed: u32 = 0, m_forbidden: u32 = 0 };
const Policy = struct { cfg: ConfigJson, tenants: []Tenant, known: *KnownKeys, callers: ?[]Caller };

/// Keys this policy already matched, so a repeated key skips SHA-256 and the scan. It holds
/// presented keys that matched a tenant, never an unknown one (a flood of bad keys cannot evict
/// anything), is direct-mapped (bounded), and lives and dies with its policy: a new
/// configuration starts with none, so a revoked key is never found here. A lookup compares the
/// full key, padded, in constant time against its one slot, whether that slot holds a key or
/// not: equality is exact (no hash stands in for the key) and the time says nothing about the
/// keys held.
const KnownKeys = struct {
    const slots = 64;
    const max_len = 128;
    const Slot = struct { key: [max_len]u8 = @splat(0), len: usize = 0, tenant: usize = 0 };
    slot: [slots]Slot = @splat(.{}),

    fn index(key: []const u8) usize {
        return @intCast(std.hash.Wyhash.hash(0, key) % slots);
    }

    fn padded(key: []const u8) [max_len]u8 {
        var out: [max_len]u8 = @splat(0);
        @memcpy(out[0..key.len], key);
        return out;
    }

    fn find(self: *const KnownKeys, key: []const u8) ?usize {
        if (key.len > max_len) return null;
        const s = &self.slot[index(key)];
        const same_bytes = std.crypto.timing_safe.eql([max_len]u8, s.key, padded(key));
        if ((@intFromBool(same_bytes) & @intFromBool(s.len == key.len)) == 0) return null;
        return s.tenant;
    }

    fn remember(self: *KnownKeys, key: []const u8, tenant: usize) void {
        if (key.len > max_len) return;
        self.slot[index(key)] = .{ .key = padded(key), .len = key.len, .tenant = tenant };
    }
};

const Root = struct {
    arena: std.heap.ArenaAllocator,
    policy: ?Policy = null,
};

var roots: std.AutoHashMapUnmanaged(u32, *Root) = .empty;
var stream_root: std.AutoHashMapUnmanaged(u32, u32) = .empty;
var m_missing: u32 = 0;
var m_unknown: u32 = 0;
var m_no_policy: u32 = 0;
var m_unknown_caller: u32 = 0;
/// A mirrored copy's denials, `meshlm_authz.shadow_denied.<reason>`: counted apart so
/// the denial and tenant counters (the dashboard's, the demo's) count each client call once.
const ShadowDenied = enum { no_policy, unknown_caller, caller_forbidden, missing_key, unknown_key, forbidden, rate_limited };
var m_shadow_denied: [@typeInfo(ShadowDenied).@"enum".field_names.len]u32 = @splat(0);
var globals_defined = false;

/// Counts a denial in `m`, or, for a mirrored copy, in its shadow_denied counter.
fn countDenial(m: u32, shadow: bool, reason: ShadowDenied) void {
    bump(if (shadow) m_shadow_denied[@intFromEnum(reason)] else m);
}

// ---- exports: lifecycle (the ABI version, memory and VM start: proxy_wasm.zig) ----
export fn proxy_on_context_create(id: u32, parent: u32) void {
    if (parent == 0) {
        const root = gpa.create(Root) catch return;
        root.* = .{ .arena = std.heap.ArenaAllocator.init(gpa) };
        roots.put(gpa, id, root) catch gpa.destroy(root);
    } else {
        stream_root.put(gpa, id, parent) catch {};
    }
}

export fn proxy_on_delete(id: u32) void {
    _ = stream_root.remove(id);
    if (roots.fetchRemove(id)) |kv| {
        kv.value.arena.deinit();
        gpa.destroy(kv.value);
    }
}

export fn proxy_on_configure(root_id: u32, size: usize) u32 {
    defer _ = scratch.reset(.{ .retain_with_limit = 64 * 1024 });
    const root = roots.get(root_id) orelse return 0;
    if (!globals_defined) {
        m_missing = metric("meshlm_authz.denied.missing_key");
        m_unknown = metric("meshlm_authz.denied.unknown_key");
        m_no_policy = metric("meshlm_authz.denied.no_policy");
        m_unknown_caller = metric("meshlm_authz.denied.unknown_caller");
        inline for (@typeInfo(ShadowDenied).@"enum".field_names, 0..) |name, i| {
            m_shadow_denied[i] = metric("meshlm_authz.shadow_denied." ++ name);
        }
        globals_defined = true;
    }
    const raw = (if (size == 0) null else abi.bufferBytes(abi.PLUGIN_CONFIGURATION, 0, size)) orelse {
        log(abi.LOG_ERROR, "rejected configuration: empty (every request will be denied)", .{});
        return 0;
    };
    var arena = std.heap.ArenaAllocator.init(gpa);
    const policy = parsePolicy(arena.allocator(), raw) catch |e| {
        arena.deinit();
        log(abi.LOG_ERROR, "rejected configuration: {s}", .{@errorName(e)});
        return 0;
    };
    // Swap in the new policy; a failed reconfigure above kept the last good one.
    root.arena.deinit();
    root.arena = arena;
    root.policy = policy;
    for (policy.tenants) |*t| initBucket(t);
    log(abi.LOG_INFO, "policy loaded for service {s}: {d} tenants", .{ policy.cfg.service, policy.tenants.len });
    return 1;
}

fn validName(s: []const u8) bool {
    if (s.len == 0 or s.len > 64) return false;
    for (s) |c| if (!(std.ascii.isAlphanumeric(c) or c == '_' or c == '-')) return false;
    return true;
}

fn parsePolicy(a: std.mem.Allocator, raw: []const u8) !Policy {
    const cfg = try std.json.parseFromSliceLeaky(ConfigJson, a, raw, .{ .allocate = .alloc_always });
    if (cfg.version != 1) return error.UnsupportedVersion;
    if (!validName(cfg.service)) return error.BadService;
    for (cfg.http_paths) |hp| {
        if (hp.path.len < 2 or hp.path[0] != '/' or !validName(hp.method)) return error.BadHttpPath;
    }
    const tenants = try a.alloc(Tenant, cfg.tenants.len);
    for (cfg.tenants, tenants, 0..) |tj, *t, i| {
        if (!validName(tj.name)) return error.BadTenantName;
        if (!validName(tj.priority)) return error.BadPriority;
        if (tj.key_sha256.len == 0) return error.TenantWithoutKeys;
        const keys = try a.alloc([32]u8, tj.key_sha256.len);
        for (tj.key_sha256, keys) |hex, *k| {
            if (hex.len != 64) return error.BadKeyHash;
            _ = std.fmt.hexToBytes(k, hex) catch return error.BadKeyHash;
        }
        for (tenants[0..i]) |prev| {
            if (std.mem.eql(u8, prev.json.name, tj.name)) return error.DuplicateTenant;
            for (prev.keys) |pk| for (keys) |k| if (std.mem.eql(u8, &pk, &k)) return error.DuplicateKeyHash;
        }
        if (tj.rate_limit) |rl| {
            if (rl.max_tokens == 0 or rl.tokens_per_fill == 0 or rl.fill_interval_ms == 0) return error.BadRateLimit;
            if (rl.fill_interval_ms > 86_400_000) return error.BadRateLimit;
        }
        t.* = .{
            .json = tj,
            .keys = keys,
            .bucket_key = try std.fmt.allocPrint(a, "meshlm_authz.bucket.{s}.{s}", .{ cfg.service, tj.name }),
        };
        var buf: [160]u8 = undefined;
        t.m_allowed = metric(try std.fmt.bufPrint(&buf, "meshlm_authz.allowed.{s}", .{tj.name}));
        t.m_forbidden = metric(try std.fmt.bufPrint(&buf, "meshlm_authz.denied.forbidden.{s}", .{tj.name}));
        t.m_limited = metric(try std.fmt.bufPrint(&buf, "meshlm_authz.denied.rate_limited.{s}", .{tj.name}));
        t.m_shadow = metric(try std.fmt.bufPrint(&buf, "meshlm_authz.shadow.{s}", .{tj.name}));
    }
    const known = try a.create(KnownKeys);
    known.* = .{};
    return .{ .cfg = cfg, .tenants = tenants, .known = known, .callers = try parseCallers(a, &cfg) };
}

fn parseCallers(a: std.mem.Allocator, cfg: *const ConfigJson) !?[]Caller {
    const cj = cfg.callers orelse return null;
    if (!cfg.peer_identity) return error.CallersWithoutPeerIdentity;
    const out = try a.alloc(Caller, cj.len);
    for (cj, out) |c, *o| {
        if (c.name.len == 0 or c.name.len > 129) return error.BadCallerName;
        if (!std.mem.startsWith(u8, c.principal, "spiffe://")) return error.BadCallerPrincipal;
        const star = std.mem.indexOfScalar(u8, c.principal, '*');
        if (star != null and star.? != c.principal.len - 1) return error.BadCallerPrincipal;
        if (c.paths) |ps| for (ps) |path| if (path.len == 0 or path[0] != '/') return error.BadCallerPath;
        var buf: [200]u8 = undefined;
        o.* = .{
            .json = c,
            .m_allowed = metric(try std.fmt.bufPrint(&buf, "meshlm_authz.caller.allowed.{s}", .{c.name})),
            .m_forbidden = metric(try std.fmt.bufPrint(&buf, "meshlm_authz.caller.denied.{s}", .{c.name})),
        };
    }
    return out;
}

// ---- token bucket in shared data: 16 bytes, tokens (u64 LE) + last fill time ns (u64 LE) ----
const Bucket = struct { tokens: u64, last_ns: u64 };

const now_ns = abi.nowNs;

fn readBucket(key: []const u8, cas: *u32) ?Bucket {
    var ptr: ?[*]u8 = null;
    var len: usize = 0;
    cas.* = 0;
    if (abi.proxy_get_shared_data(key.ptr, key.len, &ptr, &len, cas) != OK) return null;
    if (ptr == null or len != 16) return null;
    const b = ptr.?[0..16];
    return .{ .tokens = std.mem.readInt(u64, b[0..8], .little), .last_ns = std.mem.readInt(u64, b[8..16], .little) };
}

fn writeBucket(key: []const u8, b: Bucket, cas: u32) u32 {
    var buf: [16]u8 = undefined;
    std.mem.writeInt(u64, buf[0..8], b.tokens, .little);
    std.mem.writeInt(u64, buf[8..16], b.last_ns, .little);
    return abi.proxy_set_shared_data(key.ptr, key.len, &buf, buf.len, cas);
}

/// Create a full bucket once. Runs in every worker's configure, before that worker takes
/// traffic; an existing bucket (a policy update on a live sidecar) keeps its tokens.
fn initBucket(t: *const Tenant) void {
    const rl = t.json.rate_limit orelse return;
    var cas: u32 = 0;
    if (readBucket(t.bucket_key, &cas) == null)
        _ = writeBucket(t.bucket_key, .{ .tokens = rl.max_tokens, .last_ns = now_ns() }, cas);
}

/// nextCas of proxy-wasm's shared data: one counter for every write in the process, never 0.
fn casAfter(cas: u32) u32 {
    return if (cas +% 1 == 0) 1 else cas +% 1;
}

/// Take one token; returns 0 when allowed, otherwise the seconds until the next refill.
///
/// The bucket is changed only by a compare-and-swap on its shared-data CAS. After a write this
/// VM keeps the bucket it wrote and the CAS that write most likely got (the next one, when no
/// other write came between), and next time writes against that guess without reading: the
/// host accepts it only if the bucket still carries that CAS, i.e. nobody wrote since, so the
/// kept copy is the bucket itself. A wrong guess costs one refused write, then read and retry.
/// A kept copy never denies: a denial is decided on a fresh read. One kept for over a second is
/// dropped (the CAS counter cannot wrap back to the guess in that time).
fn takeToken(t: *Tenant) u64 {
    const rl = t.json.rate_limit orelse return 0;
    const interval = rl.fill_interval_ms * std.time.ns_per_ms;
    var attempt: u32 = 0;
    while (attempt < 64) : (attempt += 1) {
        const now = now_ns();
        const kept = t.written;
        t.written = null;
        var cas: u32 = 0;
        var b: Bucket = undefined;
        const fresh_kept = if (kept) |w| now >= w.at_ns and now - w.at_ns < std.time.ns_per_s else false;
        if (fresh_kept) {
            b = kept.?.bucket;
            cas = kept.?.cas;
        } else {
            b = readBucket(t.bucket_key, &cas) orelse Bucket{ .tokens = rl.max_tokens, .last_ns = now };
        }
        if (now > b.last_ns) {
            const fills = (now - b.last_ns) / interval;
            if (fills > 0) {
                b.tokens +|= fills *| rl.tokens_per_fill;
                b.last_ns += fills * interval;
            }
        }
        b.tokens = @min(b.tokens, rl.max_tokens); // also clamps after a policy lowered max_tokens
        if (b.tokens == 0) {
            if (fresh_kept) continue; // deny only on what the shared bucket holds
            const wait = (b.last_ns +| interval) -| now;
            return @max(1, (wait + std.time.ns_per_s - 1) / std.time.ns_per_s);
        }
        b.tokens -= 1;
        // Another worker changed the bucket since we read it: read again (shared data CAS).
        const rc = writeBucket(t.bucket_key, b, cas);
        if (rc == OK) {
            // A write with CAS 0 (the bucket was missing) says nothing about the CAS it got.
            if (cas != 0) t.written = .{ .bucket = b, .cas = casAfter(cas), .at_ns = now };
            return 0;
        }
        if (rc != abi.CAS_MISMATCH) break;
    }
    log(abi.LOG_WARN, "token bucket for tenant {s} contended, denying", .{t.json.name});
    return 1;
}

/// Whether the tenant's bucket holds a token now: 0 if so (none taken, nothing written), else
/// the seconds until the next fill. Read fresh from shared data, as a denial is (takeToken).
fn peekToken(t: *Tenant) u64 {
    const rl = t.json.rate_limit orelse return 0;
    const interval = rl.fill_interval_ms * std.time.ns_per_ms;
    const now = now_ns();
    var cas: u32 = 0;
    const b = readBucket(t.bucket_key, &cas) orelse return 0; // missing: a full bucket
    if (b.tokens > 0) return 0;
    if (now > b.last_ns and (now - b.last_ns) / interval > 0) return 0; // a fill is due
    const wait = (b.last_ns +| interval) -| now;
    return @max(1, (wait + std.time.ns_per_s - 1) / std.time.ns_per_s);
}

// ---- per request ----

/// The request headers the filter reads, from one proxy_get_header_map_pairs call: a get per
/// header costs a host call plus a call back into the VM to allocate the copy, and those calls,
/// not our work, are most of the filter's cost. Each field is the header's first value (what
/// proxy_get_header_map_value returns), null when the header is not there.
const RequestHeaders = struct {
    api_key: ?[]const u8 = null,
    authorization: ?[]const u8 = null,
    path: ?[]const u8 = null,
    content_type: ?[]const u8 = null,
    authority: ?[]const u8 = null,
};

/// Header map serialization of ABI 0.2.1: count, (key len, value len)*, then "key\0value\0"*.
/// A map that does not parse reads as no headers at all, which denies the request.
fn requestHeaders() RequestHeaders {
    return parsePairs(abi.requestHeaderPairs() orelse return .{}) orelse .{};
}

fn parsePairs(raw: []const u8) ?RequestHeaders {
    if (raw.len < 4) return null;
    const n = std.mem.readInt(u32, raw[0..4], .little);
    if (n > (raw.len - 4) / 8) return null;
    var at: usize = 4 + 8 * @as(usize, n);
    var h: RequestHeaders = .{};
    for (0..n) |i| {
        const sizes = raw[4 + 8 * i ..][0..8];
        const klen: usize = std.mem.readInt(u32, sizes[0..4], .little);
        const vlen: usize = std.mem.readInt(u32, sizes[4..8], .little);
        const rest = raw.len - at;
        if (klen > rest or rest - klen < 2 or vlen > rest - klen - 2) return null;
        const k = raw[at..][0..klen];
        const v = raw[at + klen + 1 ..][0..vlen];
        at += klen + vlen + 2;
        const slot: *?[]const u8 = if (std.mem.eql(u8, k, "x-api-key"))
            &h.api_key
        else if (std.mem.eql(u8, k, "authorization"))
            &h.authorization
        else if (std.mem.eql(u8, k, ":path"))
            &h.path
        else if (std.mem.eql(u8, k, "content-type"))
            &h.content_type
        else if (std.mem.eql(u8, k, ":authority"))
            &h.authority
        else
            continue;
        if (slot.* == null) slot.* = v;
    }
    return h;
}

fn nonEmpty(v: ?[]const u8) ?[]const u8 {
    const s = v orelse return null;
    return if (s.len == 0) null else s;
}

const setHeader = abi.setRequestHeader;
const removeHeader = abi.removeRequestHeader;

const ows = " \t";

/// Whether `authority` names a mirrored copy: Envoy suffixes the host with `-shadow`, before any
/// port (`llm:80` -> `llm-shadow:80`; request_mirror_policies in Envoy's route API).
fn isShadow(authority: []const u8) bool {
    var host = authority;
    if (std.mem.lastIndexOfScalar(u8, host, ':')) |i| {
        const port = host[i + 1 ..];
        if (port.len > 0 and std.mem.indexOfNone(u8, port, "0123456789") == null) host = host[0..i];
    }
    return std.mem.endsWith(u8, host, "-shadow");
}

/// The presented key: `x-api-key`, else `authorization: Bearer <key>` (scheme case-insensitive,
/// RFC 7235). Empty means missing. An empty first value counts as no header.
fn presentedKey(h: *const RequestHeaders) []const u8 {
    if (nonEmpty(h.api_key)) |v| return std.mem.trim(u8, v, ows);
    if (nonEmpty(h.authorization)) |v| {
        const s = std.mem.trim(u8, v, ows);
        if (s.len > 7 and std.ascii.startsWithIgnoreCase(s, "bearer") and (s[6] == ' ' or s[6] == '\t'))
            return std.mem.trim(u8, s[7..], ows);
    }
    return "";
}

fn findTenant(p: *const Policy, key: []const u8) ?*Tenant {
    if (p.known.find(key)) |i| return &p.tenants[i];
    var digest: [32]u8 = undefined;
    Sha256.hash(key, &digest, .{});
    // Compare against every hash so the time taken does not say which tenant matched.
    var found: ?usize = null;
    for (p.tenants, 0..) |*t, i| for (t.keys) |*k| {
        if (std.crypto.timing_safe.eql([32]u8, digest, k.*)) found = i;
    };
    const i = found orelse return null;
    p.known.remember(key, i);
    return &p.tenants[i];
}

/// `*` matches any run of bytes; everything else matches itself.
fn glob(pattern: []const u8, s: []const u8) bool {
    var p: usize = 0;
    var i: usize = 0;
    var star: ?usize = null;
    var mark: usize = 0;
    while (i < s.len) {
        if (p < pattern.len and pattern[p] == '*') {
            star = p;
            p += 1;
            mark = i;
        } else if (p < pattern.len and pattern[p] == s[i]) {
            p += 1;
            i += 1;
        } else if (star) |st| {
            p = st + 1;
            mark += 1;
            i = mark;
        } else return false;
    }
    while (p < pattern.len and pattern[p] == '*') p += 1;
    return p == pattern.len;
}

/// The gRPC method of a path in this service's API (`<method_prefix><Method>`), else null: a
/// rule never reaches another gRPC service (health checks included) behind the same sidecar.
fn methodOf(cfg: *const ConfigJson, path: []const u8) ?[]const u8 {
    const q = std.mem.indexOfScalar(u8, path, '?') orelse path.len;
    const p = path[0..q];
    if (!std.mem.startsWith(u8, p, cfg.method_prefix)) return null;
    const method = p[cfg.method_prefix.len..];
    if (method.len == 0 or std.mem.indexOfScalar(u8, method, '/') != null) return null;
    return method;
}

/// The gRPC path an OpenAI HTTP path runs (`<method_prefix><Method>`, in scratch), else null.
fn grpcPathOf(cfg: *const ConfigJson, raw_path: []const u8) ?[]const u8 {
    const q = std.mem.indexOfScalar(u8, raw_path, '?') orelse raw_path.len;
    const path = raw_path[0..q];
    for (cfg.http_paths) |hp| {
        const matches = if (std.mem.endsWith(u8, hp.path, "/*")) blk: {
            const prefix = hp.path[0 .. hp.path.len - 1];
            if (!std.mem.startsWith(u8, path, prefix)) break :blk false;
            const rest = path[prefix.len..];
            break :blk rest.len > 0 and std.mem.indexOfScalar(u8, rest, '/') == null;
        } else std.mem.eql(u8, hp.path, path);
        if (matches) return std.fmt.allocPrint(scratch.allocator(), "{s}{s}", .{ cfg.method_prefix, hp.method }) catch null;
    }
    return null;
}

/// The caller's SPIFFE ID: the first URI SAN of the certificate it presented on this connection,
/// which the listener's TLS context has verified; null on a plaintext connection.
fn peerPrincipal() ?[]const u8 {
    return abi.property("connection\x00uri_san_peer_certificate");
}

fn principalMatches(rule: []const u8, principal: []const u8) bool {
    if (rule.len > 0 and rule[rule.len - 1] == '*') return std.mem.startsWith(u8, principal, rule[0 .. rule.len - 1]);
    return std.mem.eql(u8, rule, principal);
}

/// The workload check: null when a rule naming the caller allows this path, else the denial.
/// Every rule naming the caller is tried; a denial is counted against the first.
fn checkCaller(callers: []Caller, principal: ?[]const u8, raw_path: []const u8, shadow: bool) ?Deny {
    const who = principal orelse {
        countDenial(m_unknown_caller, shadow, .unknown_caller);
        return UNKNOWN_CALLER;
    };
    const q = std.mem.indexOfScalar(u8, raw_path, '?') orelse raw_path.len;
    const path = raw_path[0..q];
    var named: ?*Caller = null;
    for (callers) |*c| {
        if (!principalMatches(c.json.principal, who)) continue;
        if (named == null) named = c;
        const allowed = if (c.json.paths) |ps| for (ps) |p| {
            if (std.mem.eql(u8, p, path)) break true;
        } else false else true;
        if (allowed) {
            bump(c.m_allowed);
            return null;
        }
    }
    if (named) |c| {
        countDenial(c.m_forbidden, shadow, .caller_forbidden);
        return CALLER_FORBIDDEN;
    }
    countDenial(m_unknown_caller, shadow, .unknown_caller);
    return UNKNOWN_CALLER;
}

/// `msg` is a gRPC caller's grpc-message; any other caller gets `json`, OpenAI's error shape.
const Deny = struct { code: u32, grpc: i32, details: []const u8, msg: []const u8, json: []const u8 };

fn denial(code: u32, grpc: i32, comptime details: []const u8, comptime msg: []const u8, comptime type_: []const u8, comptime api_code: []const u8) Deny {
    const json = "{\"error\":{\"message\":\"" ++ msg ++ "\",\"type\":\"" ++ type_ ++
        "\",\"param\":null,\"code\":\"" ++ api_code ++ "\"}}";
    return .{ .code = code, .grpc = grpc, .details = details, .msg = msg, .json = json };
}

fn deny(d: Deny, is_grpc: bool, retry_after: u64) u32 {
    var val: [20]u8 = undefined;
    var pairs: [2][2][]const u8 = undefined;
    var n: usize = 0;
    if (retry_after > 0) {
        pairs[n] = .{ "retry-after", std.fmt.bufPrint(&val, "{d}", .{retry_after}) catch "1" };
        n += 1;
    }
    if (!is_grpc) {
        pairs[n] = .{ "content-type", "application/json" };
        n += 1;
    }
    var hbuf: [128]u8 = undefined;
    const headers = abi.headerMap(&hbuf, pairs[0..n]);
    const body = if (is_grpc) d.msg else d.json;
    _ = abi.proxy_send_local_response(d.code, d.details.ptr, d.details.len, body.ptr, body.len, headers.ptr, headers.len, if (is_grpc) d.grpc else abi.NO_GRPC_STATUS);
    return STOP_ITERATION;
}

// OpenAI's shapes: a bad key is `invalid_request_error` / `invalid_api_key` as api.openai.com
// answers it; the types of 403 and 429 are those of its SDK's PermissionDenied / RateLimit.
const NO_POLICY = denial(503, 14, "meshlm_authz_no_policy", "authz policy not loaded", "server_error", "service_unavailable");
const MISSING = denial(401, 16, "meshlm_authz_missing_key", "missing api key", "invalid_request_error", "missing_api_key");
const UNKNOWN = denial(401, 16, "meshlm_authz_unknown_key", "unknown api key", "invalid_request_error", "invalid_api_key");
const FORBIDDEN = denial(403, 7, "meshlm_authz_forbidden", "tenant may not call this method", "permission_error", "method_not_allowed");
const UNKNOWN_CALLER = denial(403, 7, "meshlm_authz_unknown_caller", "workload may not call this service", "permission_error", "unknown_caller");
const CALLER_FORBIDDEN = denial(403, 7, "meshlm_authz_caller_forbidden", "workload may not call this method", "permission_error", "method_not_allowed");
const LIMITED = denial(429, 8, "meshlm_authz_rate_limited", "tenant rate limit exceeded", "rate_limit_error", "rate_limit_exceeded");

export fn proxy_on_request_headers(ctx: u32, _: u32, _: u32) u32 {
    defer _ = scratch.reset(.{ .retain_with_limit = 256 * 1024 });
    const h = requestHeaders();
    const is_grpc = std.mem.startsWith(u8, nonEmpty(h.content_type) orelse "", "application/grpc");
    // Decided first, so a denied copy is counted as one; it is denied all the same.
    const shadow = isShadow(nonEmpty(h.authority) orelse "");
    const root_id = stream_root.get(ctx) orelse 0;
    const root = roots.get(root_id) orelse {
        countDenial(m_no_policy, shadow, .no_policy);
        log(abi.LOG_ERROR, "no root context for stream; denying", .{});
        return deny(NO_POLICY, is_grpc, 0);
    };
    const p = if (root.policy) |*pp| pp else {
        countDenial(m_no_policy, shadow, .no_policy);
        log(abi.LOG_ERROR, "no valid policy loaded; denying", .{});
        return deny(NO_POLICY, is_grpc, 0);
    };
    // An OpenAI HTTP path is checked as the gRPC method it runs.
    const raw_path = nonEmpty(h.path) orelse "";
    const path = grpcPathOf(&p.cfg, raw_path) orelse raw_path;
    // Workload first: an unlisted caller reaches no key check.
    const principal = if (p.cfg.peer_identity) peerPrincipal() else null;
    if (p.callers) |cs| {
        if (checkCaller(cs, principal, path, shadow)) |d| return deny(d, is_grpc, 0);
    }
    const key = presentedKey(&h);
    if (key.len == 0) {
        countDenial(m_missing, shadow, .missing_key);
        return deny(MISSING, is_grpc, 0);
    }
    const t = findTenant(p, key) orelse {
        countDenial(m_unknown, shadow, .unknown_key);
        return deny(UNKNOWN, is_grpc, 0);
    };
    var allowed = false;
    if (methodOf(&p.cfg, path)) |method| {
        for (t.json.allow) |pat| {
            if (glob(pat, method)) allowed = true;
        }
    }
    if (!allowed) {
        countDenial(t.m_forbidden, shadow, .forbidden);
        log(abi.LOG_DEBUG, "tenant {s} denied method (forbidden)", .{t.json.name});
        return deny(FORBIDDEN, is_grpc, 0);
    }
    // A copy passes only while the tenant's bucket has a token, and takes none (the tenant's
    // call was charged where it was served): a tenant out of budget gets no copies served.
    const wait_s = if (shadow) peekToken(t) else takeToken(t);
    if (wait_s > 0) {
        countDenial(t.m_limited, shadow, .rate_limited);
        return deny(LIMITED, is_grpc, wait_s);
    }
    // The credential stays at the edge; identity headers are ours, never the client's. Only
    // headers that are there are removed (each removal is a host call).
    if (h.api_key != null) removeHeader("x-api-key");
    if (h.authorization != null) removeHeader("authorization");
    setHeader("x-meshlm-tenant", t.json.name);
    setHeader("x-meshlm-priority", t.json.priority);
    if (principal) |who| setHeader("x-meshlm-principal", who);
    if (t.json.token_budget) |b| setHeader("x-meshlm-token-budget", b);
    bump(t.m_allowed);
    if (shadow) bump(t.m_shadow); // allowed, uncharged
    return CONTINUE;
}
