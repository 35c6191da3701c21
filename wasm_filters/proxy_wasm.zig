//! The proxy-wasm ABI 0.2.1 as both filters (authz.zig, classify.zig) use it: the host's
//! imports (module "env"), the status and enum values, the exports every module must have
//! (ABI version, memory allocation, VM start), the scratch arena that holds what the host hands
//! over, and small wrappers of the host calls. Each filter keeps its own context callbacks.
//! Values and signatures: proxy-wasm spec, ABI 0.2.1.

const std = @import("std");

// ---- host imports ----
pub extern "env" fn proxy_log(level: u32, msg: [*]const u8, len: usize) u32;
pub extern "env" fn proxy_get_buffer_bytes(kind: u32, start: usize, max: usize, out: *?[*]u8, out_len: *usize) u32;
pub extern "env" fn proxy_get_header_map_pairs(map: u32, out: *?[*]u8, out_len: *usize) u32;
pub extern "env" fn proxy_get_header_map_value(map: u32, key: [*]const u8, key_len: usize, out: *?[*]u8, out_len: *usize) u32;
pub extern "env" fn proxy_replace_header_map_value(map: u32, key: [*]const u8, key_len: usize, val: [*]const u8, val_len: usize) u32;
pub extern "env" fn proxy_remove_header_map_value(map: u32, key: [*]const u8, key_len: usize) u32;
pub extern "env" fn proxy_send_local_response(code: u32, details: [*]const u8, details_len: usize, body: [*]const u8, body_len: usize, headers: [*]const u8, headers_len: usize, grpc_status: i32) u32;
pub extern "env" fn proxy_get_shared_data(key: [*]const u8, key_len: usize, out: *?[*]u8, out_len: *usize, cas: *u32) u32;
pub extern "env" fn proxy_set_shared_data(key: [*]const u8, key_len: usize, val: [*]const u8, val_len: usize, cas: u32) u32;
pub extern "env" fn proxy_define_metric(kind: u32, name: [*]const u8, name_len: usize, out_id: *u32) u32;
pub extern "env" fn proxy_increment_metric(id: u32, offset: i64) u32;
pub extern "env" fn proxy_get_current_time_nanoseconds(out: *u64) u32;
pub extern "env" fn proxy_get_property(path: [*]const u8, path_len: usize, out: *?[*]u8, out_len: *usize) u32;

// ---- values ----
// WasmResult
pub const OK: u32 = 0;
pub const NOT_FOUND: u32 = 1;
pub const CAS_MISMATCH: u32 = 8;
// MapType
pub const REQUEST_HEADERS: u32 = 0;
// BufferType
pub const REQUEST_BODY: u32 = 0;
pub const PLUGIN_CONFIGURATION: u32 = 7;
// MetricType
pub const COUNTER: u32 = 0;
// LogLevel
pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;
// FilterHeadersStatus, FilterTrailersStatus
pub const CONTINUE: u32 = 0;
pub const STOP_ITERATION: u32 = 1;
// FilterDataStatus
pub const STOP_AND_BUFFER: u32 = 1;
// proxy_send_local_response: not a gRPC answer
pub const NO_GRPC_STATUS: i32 = -1;

/// Everything the host hands us (header values, configuration and body bytes, shared data) is
/// allocated here by proxy_on_memory_allocate, and dropped at the end of each exported call
/// (`defer _ = scratch.reset(...)`): the host never keeps pointers into our memory.
pub var scratch = std.heap.ArenaAllocator.init(std.heap.wasm_allocator);

// ---- exports every module has ----
export fn proxy_abi_version_0_2_1() void {}

export fn proxy_on_memory_allocate(size: usize) ?[*]u8 {
    const mem = scratch.allocator().alloc(u8, @max(size, 1)) catch return null;
    return mem.ptr;
}

export fn proxy_on_vm_start(_: u32, _: usize) u32 {
    return 1;
}

// ---- wrappers ----
pub fn log(level: u32, comptime fmt: []const u8, args: anytype) void {
    var buf: [512]u8 = undefined;
    const msg = std.fmt.bufPrint(&buf, fmt, args) catch buf[0..];
    _ = proxy_log(level, msg.ptr, msg.len);
}

/// A counter's id; 0 (never counted) when the host refuses it.
pub fn metric(name: []const u8) u32 {
    var id: u32 = 0;
    if (proxy_define_metric(COUNTER, name.ptr, name.len, &id) != OK) return 0;
    return id;
}

pub fn bump(id: u32) void {
    if (id != 0) _ = proxy_increment_metric(id, 1);
}

/// Up to `max` bytes of a buffer from `start` (in scratch), null when unreadable.
pub fn bufferBytes(kind: u32, start: usize, max: usize) ?[]const u8 {
    var ptr: ?[*]u8 = null;
    var len: usize = 0;
    if (proxy_get_buffer_bytes(kind, start, max, &ptr, &len) != OK or ptr == null) return null;
    return ptr.?[0..len];
}

/// A request header's first value (in scratch), null when absent.
pub fn requestHeader(name: []const u8) ?[]const u8 {
    var ptr: ?[*]u8 = null;
    var len: usize = 0;
    if (proxy_get_header_map_value(REQUEST_HEADERS, name.ptr, name.len, &ptr, &len) != OK) return null;
    if (ptr == null) return null;
    return ptr.?[0..len];
}

/// Every request header in one host call, serialized (see headerMap); null when unreadable.
pub fn requestHeaderPairs() ?[]const u8 {
    var ptr: ?[*]u8 = null;
    var len: usize = 0;
    if (proxy_get_header_map_pairs(REQUEST_HEADERS, &ptr, &len) != OK or ptr == null) return null;
    return ptr.?[0..len];
}

/// Set a request header; setting one from Wasm clears the route cache (RDS matches see it).
pub fn setRequestHeader(name: []const u8, value: []const u8) void {
    _ = proxy_replace_header_map_value(REQUEST_HEADERS, name.ptr, name.len, value.ptr, value.len);
}

pub fn removeRequestHeader(name: []const u8) void {
    _ = proxy_remove_header_map_value(REQUEST_HEADERS, name.ptr, name.len);
}

/// Header map serialization: count, (key len, value len)*, then "key\0value\0"* (u32 LE).
pub fn headerMap(buf: []u8, pairs: []const [2][]const u8) []const u8 {
    std.mem.writeInt(u32, buf[0..4], @intCast(pairs.len), .little);
    var at: usize = 4 + 8 * pairs.len;
    for (pairs, 0..) |kv, i| {
        std.mem.writeInt(u32, buf[4 + 8 * i ..][0..4], @intCast(kv[0].len), .little);
        std.mem.writeInt(u32, buf[8 + 8 * i ..][0..4], @intCast(kv[1].len), .little);
        for (kv) |part| {
            @memcpy(buf[at..][0..part.len], part);
            buf[at + part.len] = 0;
            at += part.len + 1;
        }
    }
    return buf[0..at];
}

/// A property's value (in scratch), its path parts separated by NUL; null when absent or empty.
pub fn property(path: []const u8) ?[]const u8 {
    var ptr: ?[*]u8 = null;
    var len: usize = 0;
    if (proxy_get_property(path.ptr, path.len, &ptr, &len) != OK or ptr == null or len == 0) return null;
    return ptr.?[0..len];
}

pub fn nowNs() u64 {
    var t: u64 = 0;
    _ = proxy_get_current_time_nanoseconds(&t);
    return t;
}
