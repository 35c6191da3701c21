//! meshlm classify: a proxy-wasm (ABI 0.2.1) HTTP filter for the caller-side (outbound)
//! listener that sets `x-meshlm-class` on every Generate call, so routes can steer a request
//! class (semantic circuit breaking: a failing class is quarantined by the control plane).
//!
//! The class key: sha256("meshlm-class-v1", :authority, kind, normalised text), first 8 bytes as
//! 16 lowercase hex characters. kind is what the request carries: the last user message of
//! `messages` (else the last message), `prompt`, or `prompt_token_ids`. The text is ASCII-
//! lowercased, whitespace runs become one space, ends are trimmed, and only its first
//! `prefix_bytes` (default 64) count. Why this key:
//! - the same kind of request shares a class: requests that open alike (a template, a repeated
//!   query of death) collide on purpose; sampling settings, request ids and the system prompt
//!   (shared by every call of one app) are left out, or each call would be its own class;
//! - no tenant: the caller sidecar does not know it (authz runs in the runtime's sidecar), and a
//!   query of death is poison whoever sends it, so it must cluster across tenants;
//! - :authority keeps equal texts to different services apart;
//! - only a hash leaves the filter: no prompt text in headers, logs or stats.
//! Bodies: the filter pauses Generate calls only, buffers until the first gRPC frame is whole
//! (5-byte prefix + one FlatBuffers GenerateRequest) or `max_body_bytes` (default 320 KiB, above
//! the runtime's 256 KiB prompt limit) have arrived, then classifies. A frame over the limit is
//! classified by its prefix: text that lies inside it counts (the class it would get whole);
//! text past it (builders put strings behind the table) leaves the kind alone, marked truncated,
//! so such oversized requests of one kind share a class. A body that is not a GenerateRequest
//! (bad offsets, compressed frame, no text field) gets no class and passes on unchanged; the
//! runtime rejects it as it would without this filter. A client-sent `x-meshlm-class` is always
//! removed. Every read of the body is bounds-checked: a hostile body cannot crash the VM.
//! The same pass sets `x-meshlm-prefix`, the prompt-prefix key that `prefix_aware` routes hash
//! (prefix.zig); it also reads OpenAI JSON bodies (/v1/chat/completions, /v1/completions) whole,
//! up to `max_body_bytes`, for that key alone. A client-sent key is always removed; a body it
//! cannot read passes unkeyed.
//! The same pass sets `x-meshlm-model`, the model the request names: the top-level `"model"`
//! string of an OpenAI body, or GenerateRequest.model (field 1). Only a name of OpenAI's model-id
//! shape (1-128 of `A-Za-z0-9._:/-`) is set, as sent (routes compare it case-insensitively); a
//! body without one, or one the filter cannot read (a string past `max_body_bytes`, bad JSON or
//! offsets), passes without it. A client-sent `x-meshlm-model` is always removed, so a caller
//! sidecar's route by model (a Host that names no service) follows the body, never a header.
//! This is not an authz filter: it is deployed with failure_policy FAIL_OPEN (after a VM failure
//! calls pass unclassified; Envoy fails the one call that was inside the VM with UNAVAILABLE; the
//! listener strips client-sent class headers before this filter). See classify_xds.py.
//! Build: `python -m wasm_filters.build`.

const std = @import("std");
const Sha256 = std.crypto.hash.sha2.Sha256;
const abi = @import("proxy_wasm.zig");
const CONTINUE = abi.CONTINUE;
const bump = abi.bump;
const log = abi.log;
const scratch = &abi.scratch;

const CLASS_HEADER = "x-meshlm-class";
const PREFIX_HEADER = "x-meshlm-prefix";
const MODEL_HEADER = "x-meshlm-model";
const MODEL_MAX = 128;
const GENERATE_PATH = "/meshlm.inference.v1.Inference/Generate";
const FRAME_PREFIX = 5; // gRPC: compressed flag (1) + message length (u32 big endian)

const gpa = std.heap.wasm_allocator;

const Config = struct {
    prefix_bytes: u32 = 64,
    max_body_bytes: u32 = 320 * 1024,
    // The prefix key (prefix.zig): block size in bytes, and how many leading blocks count.
    block_bytes: u32 = 64,
    prefix_blocks: u32 = 16,
};

/// What a paused stream's body is.
const Body = enum { generate, openai_chat, openai_completions };

var roots: std.AutoHashMapUnmanaged(u32, Config) = .empty;
var stream_root: std.AutoHashMapUnmanaged(u32, u32) = .empty;
/// Streams paused in on_request_headers, waiting for their body.
var pending: std.AutoHashMapUnmanaged(u32, Body) = .empty;

var m_classified: u32 = 0;
var m_prefix: u32 = 0;
var m_invalid: u32 = 0;
var m_no_body: u32 = 0;
var m_keyed: u32 = 0;
var m_unkeyed: u32 = 0;
var m_model: u32 = 0;
var m_model_absent: u32 = 0;
var m_model_malformed: u32 = 0;
var globals_defined = false;

// ---- lifecycle (the ABI version, memory and VM start: proxy_wasm.zig) ----
export fn proxy_on_context_create(id: u32, parent: u32) void {
    if (parent == 0) {
        roots.put(gpa, id, .{}) catch {};
    } else {
        stream_root.put(gpa, id, parent) catch {};
    }
}

export fn proxy_on_done(_: u32) u32 {
    return 1;
}

export fn proxy_on_delete(id: u32) void {
    _ = stream_root.remove(id);
    _ = pending.remove(id);
    _ = roots.remove(id);
}

export fn proxy_on_configure(root_id: u32, size: usize) u32 {
    defer _ = scratch.reset(.{ .retain_with_limit = 16 * 1024 });
    if (!globals_defined) {
        m_classified = abi.metric("meshlm_classify.classified");
        m_prefix = abi.metric("meshlm_classify.classified_by_prefix");
        m_invalid = abi.metric("meshlm_classify.unclassified.invalid");
        m_no_body = abi.metric("meshlm_classify.unclassified.no_body");
        m_keyed = abi.metric("meshlm_classify.prefix_keyed");
        m_unkeyed = abi.metric("meshlm_classify.prefix_unkeyed");
        m_model = abi.metric("meshlm_classify.model_named");
        m_model_absent = abi.metric("meshlm_classify.model_absent");
        m_model_malformed = abi.metric("meshlm_classify.model_malformed");
        globals_defined = true;
    }
    const slot = roots.getPtr(root_id) orelse return 0;
    var cfg = Config{};
    if (size > 0) {
        const raw = abi.bufferBytes(abi.PLUGIN_CONFIGURATION, 0, size) orelse {
            log(abi.LOG_ERROR, "rejected configuration: unreadable", .{});
            return 0;
        };
        cfg = parseConfig(raw) catch |e| {
            log(abi.LOG_ERROR, "rejected configuration: {s}", .{@errorName(e)});
            return 0;
        };
    }
    slot.* = cfg;
    log(abi.LOG_INFO, "classify: prefix_bytes={d} max_body_bytes={d} block_bytes={d} prefix_blocks={d}", .{ cfg.prefix_bytes, cfg.max_body_bytes, cfg.block_bytes, cfg.prefix_blocks });
    return 1;
}

fn parseConfig(raw: []const u8) !Config {
    const cfg = try std.json.parseFromSliceLeaky(Config, scratch.allocator(), raw, .{});
    if (cfg.prefix_bytes < 1 or cfg.prefix_bytes > 4096) return error.BadPrefixBytes;
    // Envoy's default per-connection buffer limit is 1 MiB; stay well under it.
    if (cfg.max_body_bytes < 64 or cfg.max_body_bytes > 512 * 1024) return error.BadMaxBodyBytes;
    if (cfg.block_bytes < 1 or cfg.block_bytes > 4096) return error.BadBlockBytes;
    if (cfg.prefix_blocks < 1 or cfg.prefix_blocks > 1024) return error.BadPrefixBlocks;
    return cfg;
}

// ---- headers ----
const header = abi.requestHeader;

export fn proxy_on_request_headers(ctx: u32, _: u32, end_of_stream: u32) u32 {
    defer _ = scratch.reset(.{ .retain_with_limit = 16 * 1024 });
    // The class, the prefix key and the model are ours alone, whatever happens next.
    abi.removeRequestHeader(CLASS_HEADER);
    abi.removeRequestHeader(PREFIX_HEADER);
    abi.removeRequestHeader(MODEL_HEADER);
    const kind = bodyKind() orelse return CONTINUE;
    if (end_of_stream != 0) {
        if (kind == .generate) bump(m_no_body);
        return CONTINUE;
    }
    pending.put(gpa, ctx, kind) catch return CONTINUE; // out of memory: unclassified, not stuck
    // Hold the headers (and so route selection) until the body says which class this is.
    return abi.STOP_ITERATION;
}

/// The body this filter reads: a gRPC Generate call, an OpenAI completion (JSON), or none.
fn bodyKind() ?Body {
    const full_path = header(":path") orelse return null;
    const ctype = header("content-type") orelse return null;
    const path = full_path[0 .. std.mem.indexOfScalar(u8, full_path, '?') orelse full_path.len];
    if (std.mem.startsWith(u8, ctype, "application/grpc"))
        return if (std.mem.eql(u8, path, GENERATE_PATH)) .generate else null;
    if (!std.mem.startsWith(u8, ctype, "application/json")) return null;
    if (std.mem.eql(u8, path, prefix_key.OPENAI_CHAT)) return .openai_chat;
    if (std.mem.eql(u8, path, prefix_key.OPENAI_COMPLETIONS)) return .openai_completions;
    return null;
}

export fn proxy_on_request_body(ctx: u32, body_size: usize, end_of_stream: u32) u32 {
    defer _ = scratch.reset(.{ .retain_with_limit = 256 * 1024 });
    const kind = pending.get(ctx) orelse return CONTINUE;
    const cfg = roots.get(stream_root.get(ctx) orelse 0) orelse Config{};
    if (kind != .generate) return openAiBody(ctx, kind, body_size, end_of_stream, cfg);
    const want = wanted(body_size, cfg.max_body_bytes);
    if (body_size < want and end_of_stream == 0) return abi.STOP_AND_BUFFER;
    _ = pending.remove(ctx);
    if (body_size < want) { // the stream ended inside its first frame
        bump(m_invalid);
        bump(m_model_absent);
        return CONTINUE;
    }
    const n = @min(body_size, want);
    const body = (if (n == 0) null else abi.bufferBytes(abi.REQUEST_BODY, 0, n)) orelse {
        bump(m_invalid);
        bump(m_model_absent);
        return CONTINUE;
    };
    setModel(generateModel(body[0..@min(body.len, n)]));
    var key: [16]u8 = undefined;
    const by_prefix = classify(body[0..@min(body.len, n)], header(":authority") orelse "", cfg.prefix_bytes, &key) catch {
        bump(m_invalid);
        return CONTINUE;
    };
    // Setting a request header from Wasm clears the route cache: RDS matches see the class.
    abi.setRequestHeader(CLASS_HEADER, &key);
    bump(m_classified);
    if (by_prefix) bump(m_prefix);
    const msg = body[FRAME_PREFIX..@min(body.len, n)];
    const whole = msg.len == std.mem.readInt(u32, body[1..5], .big);
    setPrefixKey(prefix_key.ofGenerate(.{ .buf = msg, .whole = whole }, cfg.block_bytes, cfg.prefix_blocks) catch null);
    return CONTINUE;
}

/// An OpenAI body is read whole (JSON), up to max_body_bytes; a larger one passes unkeyed.
fn openAiBody(ctx: u32, kind: Body, body_size: usize, end_of_stream: u32, cfg: Config) u32 {
    if (body_size > cfg.max_body_bytes) {
        _ = pending.remove(ctx);
        bump(m_unkeyed);
        bump(m_model_absent);
        return CONTINUE;
    }
    if (end_of_stream == 0) return abi.STOP_AND_BUFFER;
    _ = pending.remove(ctx);
    const body = abi.bufferBytes(abi.REQUEST_BODY, 0, body_size) orelse {
        bump(m_unkeyed);
        bump(m_model_absent);
        return CONTINUE;
    };
    const root = std.json.parseFromSliceLeaky(std.json.Value, scratch.allocator(), body, .{}) catch {
        bump(m_unkeyed);
        bump(m_model_absent);
        return CONTINUE;
    };
    setModel(jsonModel(root));
    const path = if (kind == .openai_chat) prefix_key.OPENAI_CHAT else prefix_key.OPENAI_COMPLETIONS;
    setPrefixKey(prefix_key.ofOpenAiJson(path, root, cfg.block_bytes, cfg.prefix_blocks));
    return CONTINUE;
}

/// What a body says of its model: a name to route on, none, or one that cannot be a model id.
const Model = union(enum) { name: []const u8, absent, malformed };

fn setModel(m: Model) void {
    switch (m) {
        .name => |name| {
            abi.setRequestHeader(MODEL_HEADER, name);
            bump(m_model);
        },
        .absent => bump(m_model_absent),
        .malformed => bump(m_model_malformed),
    }
}

/// OpenAI's model-id shape; anything else (spaces, controls, non-ASCII) is never a header value.
fn modelName(s: []const u8) Model {
    if (s.len == 0) return .absent; // GenerateRequest's default: no model named
    if (s.len > MODEL_MAX) return .malformed;
    for (s) |c| {
        const ok = std.ascii.isAlphanumeric(c) or c == '.' or c == '_' or c == ':' or c == '/' or c == '-';
        if (!ok) return .malformed;
    }
    return .{ .name = s };
}

/// The top-level `"model"` of an OpenAI body: a string, or nothing to route on.
fn jsonModel(root: std.json.Value) Model {
    const obj = switch (root) {
        .object => |o| o,
        else => return .absent,
    };
    return switch (obj.get("model") orelse return .absent) {
        .string => |s| modelName(s),
        else => .malformed,
    };
}

fn setPrefixKey(key: ?prefix_key.Key) void {
    if (key) |k| {
        abi.setRequestHeader(PREFIX_HEADER, &k);
        bump(m_keyed);
    } else bump(m_unkeyed);
}

/// A stream that ends in trailers before its frame was whole goes on unclassified.
export fn proxy_on_request_trailers(ctx: u32, _: u32) u32 {
    if (pending.fetchRemove(ctx)) |kv| {
        bump(if (kv.value == .generate) m_invalid else m_unkeyed);
        bump(m_model_absent);
    }
    return CONTINUE;
}

/// Bytes to wait for: the whole first frame, capped at the limit; the prefix first.
fn wanted(body_size: usize, limit: usize) usize {
    if (body_size < FRAME_PREFIX) return FRAME_PREFIX;
    const prefix = abi.bufferBytes(abi.REQUEST_BODY, 0, FRAME_PREFIX) orelse return 0;
    if (prefix.len < FRAME_PREFIX) return 0;
    const msg_len = std.mem.readInt(u32, prefix[1..5], .big);
    return @min(@as(usize, FRAME_PREFIX) +| msg_len, limit);
}

// ---- the body ----
const flatbuf = @import("flatbuf.zig");
const prefix_key = @import("prefix.zig");
const Invalid = flatbuf.Invalid;
const Fb = flatbuf.Fb;
const Seen = flatbuf.Seen;
const seen = flatbuf.seen;

// GenerateRequest fields (schemas/inference.fbs): model 1, prompt 2, prompt_token_ids 3,
// messages 4; ChatMessage: role 0, content 1.
const F_MODEL = 1;
const F_PROMPT = 2;
const F_IDS = 3;
const F_MESSAGES = 4;

/// GenerateRequest.model of the gRPC frame in `body` (maybe a prefix of it): only a string
/// wholly inside the bytes held counts.
fn generateModel(body: []const u8) Model {
    @setRuntimeSafety(true);
    if (body.len < FRAME_PREFIX or body[0] != 0) return .absent; // compressed: unreadable
    const msg_len = std.mem.readInt(u32, body[1..5], .big);
    const msg = body[FRAME_PREFIX..];
    if (msg.len > msg_len) return .absent; // a second frame: not one unary request
    const fb = Fb{ .buf = msg, .whole = msg.len == msg_len };
    const root = fb.table(fb.u32At(0) catch return .absent) catch return .absent;
    const name = (root.bytes(F_MODEL, 1) catch return .absent) orelse return .absent;
    if (!name.complete) return .absent;
    return modelName(name.data);
}

/// Fill `key` (16 hex chars) for the gRPC frame in `body`; true when classified by a prefix.
fn classify(body: []const u8, authority: []const u8, prefix_bytes: u32, key: *[16]u8) Invalid!bool {
    @setRuntimeSafety(true);
    if (body.len < FRAME_PREFIX or body[0] != 0) return error.Invalid; // compressed: unreadable
    const msg_len = std.mem.readInt(u32, body[1..5], .big);
    const msg = body[FRAME_PREFIX..];
    if (msg.len > msg_len) return error.Invalid; // a second frame: not one unary request
    const fb = Fb{ .buf = msg, .whole = msg.len == msg_len };
    const root = try fb.table(try fb.u32At(0));
    var h = Sha256.init(.{});
    h.update("meshlm-class-v1\x00");
    for (authority) |c| h.update(&[_]u8{std.ascii.toLower(c)});
    h.update("\x00");
    var text: Seen = undefined;
    var raw = false;
    var kinds: u32 = 0;
    if (try root.bytes(F_PROMPT, 1)) |p| {
        kinds += 1;
        text = p;
        h.update("prompt\x00");
    }
    if (try root.bytes(F_IDS, 4)) |ids| {
        kinds += 1;
        // Token ids are not text: the first prefix_bytes of their little-endian bytes count.
        text = .{ .data = ids.data[0 .. ids.data.len - ids.data.len % 4], .complete = ids.complete };
        raw = true;
        h.update("ids\x00");
    }
    if (try root.ref(F_MESSAGES)) |at| {
        kinds += 1;
        text = try lastUserMessage(fb, at);
        h.update("messages\x00");
    }
    if (kinds != 1) return error.Invalid; // the runtime requires exactly one
    var norm = Normaliser{ .h = &h, .left = prefix_bytes };
    if (raw) norm.feedRaw(text.data) else norm.feed(text.data);
    // A text cut short by the prefix, before it filled prefix_bytes, is not that short text.
    if (!text.complete and norm.left > 0) h.update("\x00truncated");
    var digest: [32]u8 = undefined;
    h.final(&digest);
    key.* = std.fmt.bytesToHex(digest[0..8], .lower);
    return !fb.whole;
}

/// The content of the last message whose role is "user", else of the last message.
fn lastUserMessage(fb: Fb, at: usize) Invalid!Seen {
    @setRuntimeSafety(true);
    const n = fb.u32At(at) catch {
        if (fb.whole) return error.Invalid;
        return .{ .data = "", .complete = false };
    };
    if (n == 0) return error.Invalid;
    const room = (fb.buf.len - at - 4) / 4; // u32At(at) succeeded: at + 4 <= len
    if (n > room and fb.whole) return error.Invalid;
    var pick: ?Seen = null;
    var last: ?Seen = null;
    var i: usize = @min(n, room);
    while (i > 0) {
        i -= 1;
        const slot = at + 4 + 4 * i;
        const off = fb.u32At(slot) catch {
            if (fb.whole) return error.Invalid;
            continue; // this element's offset lies past the prefix
        };
        const msg = fb.table(slot +| off) catch {
            if (fb.whole) return error.Invalid;
            continue;
        };
        const content = (try msg.bytes(1, 1)) orelse return error.Invalid; // required
        const role = (try msg.bytes(0, 1)) orelse return error.Invalid;
        if (last == null) last = content;
        if (role.complete and std.mem.eql(u8, role.data, "user")) {
            pick = content;
            break;
        }
    }
    return pick orelse last orelse .{ .data = "", .complete = false };
}

/// Lowercase ASCII, collapse whitespace runs to one space, trim; hash at most `left` bytes.
const Normaliser = struct {
    h: *Sha256,
    left: u32,
    space: bool = false,
    started: bool = false,

    fn feed(self: *Normaliser, data: []const u8) void {
        for (data) |c| {
            if (self.left == 0) return;
            if (std.ascii.isWhitespace(c)) {
                self.space = self.started;
                continue;
            }
            if (self.space) {
                self.emit(' ');
                self.space = false;
                if (self.left == 0) return;
            }
            self.emit(std.ascii.toLower(c));
            self.started = true;
        }
    }

    fn feedRaw(self: *Normaliser, data: []const u8) void {
        const n = @min(data.len, self.left);
        self.h.update(data[0..n]);
        self.left -= @intCast(n);
    }

    fn emit(self: *Normaliser, c: u8) void {
        self.h.update(&[_]u8{c});
        self.left -= 1;
    }
};
