//! The prefix key of a Generate call (gRPC FlatBuffers) or an OpenAI completion (JSON): a hash
//! of the prompt's leading blocks, for routes that hash on it (cache-aware routing: calls that
//! share a prompt prefix go to the replica that holds its KV cache).
//!
//! The prompt as one byte stream: `prompt` as it is; `prompt_token_ids` as u32 little-endian;
//! `messages` as role, NUL, content, NUL for each message in order (system prompt + conversation
//! so far). The stream is cut into blocks of `block_bytes` (default 64, about the 16 tokens of
//! the runtime's KV block); only whole blocks count, as only whole KV blocks are cached. The hash
//! is chained like the runtime's block keys: h0 = sha256("meshlm-prefix-v1", kind), hi =
//! sha256(h(i-1), block i), over at most `prefix_blocks` (default 16) leading blocks; the key is
//! the last link, first 8 bytes as 16 lowercase hex characters. A prompt shorter than one block
//! has no key (its call is spread by the balancer). The same prompt gets the same key over gRPC
//! and over the OpenAI API (the runtime renders both alike). A fixed leading window keeps a
//! growing conversation on one key; apps whose shared text is longer than the window share one
//! key, and the balancer's bounded load spreads a key that is too hot for one replica.

const std = @import("std");
const Sha256 = std.crypto.hash.sha2.Sha256;
const flatbuf = @import("flatbuf.zig");

pub const Key = [16]u8;

/// Chained block hashes over a stream fed in pieces.
pub const Chain = struct {
    block_bytes: u32,
    max_blocks: u32,
    h: Sha256,
    link: [32]u8 = undefined,
    fill: u32 = 0,
    blocks: u32 = 0,

    pub fn init(kind: []const u8, block_bytes: u32, max_blocks: u32) Chain {
        var seed = Sha256.init(.{});
        seed.update("meshlm-prefix-v1\x00");
        seed.update(kind);
        var c = Chain{ .block_bytes = block_bytes, .max_blocks = max_blocks, .h = undefined };
        seed.final(&c.link);
        c.h = next(c.link);
        return c;
    }

    fn next(link: [32]u8) Sha256 {
        var h = Sha256.init(.{});
        h.update(&link);
        return h;
    }

    pub fn full(self: *const Chain) bool {
        return self.blocks >= self.max_blocks;
    }

    pub fn feed(self: *Chain, data: []const u8) void {
        var rest = data;
        while (rest.len > 0 and !self.full()) {
            const n = @min(rest.len, self.block_bytes - self.fill);
            self.h.update(rest[0..n]);
            self.fill += @intCast(n);
            rest = rest[n..];
            if (self.fill == self.block_bytes) {
                self.h.final(&self.link);
                self.h = next(self.link);
                self.fill = 0;
                self.blocks += 1;
            }
        }
    }

    /// The key over the whole blocks fed so far; null before the first one.
    pub fn key(self: *const Chain) ?Key {
        if (self.blocks == 0) return null;
        return std.fmt.bytesToHex(self.link[0..8], .lower);
    }
};

// GenerateRequest fields (schemas/inference.fbs): prompt 2, prompt_token_ids 3, messages 4;
// ChatMessage: role 0, content 1.
const F_PROMPT = 2;
const F_IDS = 3;
const F_MESSAGES = 4;

/// The key of the GenerateRequest in `fb` (maybe a prefix of it: what is there counts).
pub fn ofGenerate(fb: flatbuf.Fb, block_bytes: u32, max_blocks: u32) flatbuf.Invalid!?Key {
    @setRuntimeSafety(true); // a missed check traps (fail open), never reads wild memory
    const root = try fb.table(try fb.u32At(0));
    if (try root.bytes(F_PROMPT, 1)) |p| {
        var c = Chain.init("prompt", block_bytes, max_blocks);
        c.feed(p.data);
        return c.key();
    }
    if (try root.bytes(F_IDS, 4)) |ids| {
        var c = Chain.init("ids", block_bytes, max_blocks);
        c.feed(ids.data[0 .. ids.data.len - ids.data.len % 4]);
        return c.key();
    }
    const at = (try root.ref(F_MESSAGES)) orelse return null;
    var c = Chain.init("chat", block_bytes, max_blocks);
    const n = fb.u32At(at) catch {
        if (fb.whole) return error.Invalid;
        return null;
    };
    var i: usize = 0;
    while (i < n and !c.full()) : (i += 1) {
        const slot = at + 4 + 4 * i;
        const off = fb.u32At(slot) catch {
            if (fb.whole) return error.Invalid;
            break; // the rest lies past the prefix we hold
        };
        const msg = fb.table(slot +| off) catch {
            if (fb.whole) return error.Invalid;
            break;
        };
        const role = (try msg.bytes(0, 1)) orelse return error.Invalid;
        const content = (try msg.bytes(1, 1)) orelse return error.Invalid;
        if (!feedPart(&c, role) or !feedPart(&c, content)) break;
    }
    return c.key();
}

/// Feed one string and its NUL; false when it was cut short (the stream stops there).
fn feedPart(c: *Chain, s: flatbuf.Seen) bool {
    c.feed(s.data);
    if (!s.complete) return false;
    c.feed("\x00");
    return true;
}

pub const OPENAI_CHAT = "/v1/chat/completions";
pub const OPENAI_COMPLETIONS = "/v1/completions";

/// The key of an OpenAI request body (the whole of it); null for any shape it does not know.
pub fn ofOpenAi(alloc: std.mem.Allocator, path: []const u8, body: []const u8, block_bytes: u32, max_blocks: u32) ?Key {
    const root = std.json.parseFromSliceLeaky(std.json.Value, alloc, body, .{}) catch return null;
    return ofOpenAiJson(path, root, block_bytes, max_blocks);
}

/// The key of an OpenAI request body already parsed (the classify filter reads its `model` too).
pub fn ofOpenAiJson(path: []const u8, root: std.json.Value, block_bytes: u32, max_blocks: u32) ?Key {
    const obj = switch (root) {
        .object => |o| o,
        else => return null,
    };
    if (std.mem.eql(u8, path, OPENAI_CHAT)) {
        const msgs = switch (obj.get("messages") orelse return null) {
            .array => |a| a,
            else => return null,
        };
        var c = Chain.init("chat", block_bytes, max_blocks);
        for (msgs.items) |m| {
            if (c.full()) break;
            const mo = switch (m) {
                .object => |o| o,
                else => return null,
            };
            c.feed(string(mo.get("role")) orelse return null);
            c.feed("\x00");
            feedContent(&c, mo.get("content") orelse .null) orelse return null;
            c.feed("\x00");
        }
        return c.key();
    }
    switch (obj.get("prompt") orelse return null) {
        .string => |s| {
            var c = Chain.init("prompt", block_bytes, max_blocks);
            c.feed(s);
            return c.key();
        },
        .array => |a| { // token ids, as prompt_token_ids
            var c = Chain.init("ids", block_bytes, max_blocks);
            for (a.items) |v| {
                if (c.full()) break;
                const id = switch (v) {
                    .integer => |i| std.math.cast(u32, i) orelse return null,
                    else => return null,
                };
                var le: [4]u8 = undefined;
                std.mem.writeInt(u32, &le, id, .little);
                c.feed(&le);
            }
            return c.key();
        },
        else => return null,
    }
}

fn string(v: ?std.json.Value) ?[]const u8 {
    return switch (v orelse return null) {
        .string => |s| s,
        else => null,
    };
}

/// A message's content: a string, null (a tool call), or text parts (their texts in order).
fn feedContent(c: *Chain, v: std.json.Value) ?void {
    switch (v) {
        .string => |s| c.feed(s),
        .null => {},
        .array => |parts| for (parts.items) |p| {
            const po = switch (p) {
                .object => |o| o,
                else => return null,
            };
            if (string(po.get("text"))) |t| c.feed(t);
        },
        else => return null,
    }
}
