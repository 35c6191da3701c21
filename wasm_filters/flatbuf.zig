//! A bounds-checked reader of FlatBuffers buffers of which only a prefix may be present (the
//! Wasm filters read a gRPC frame's GenerateRequest while its body is still arriving). Every
//! read checks its bounds: a hostile buffer cannot make a filter read outside it.

const std = @import("std");

pub const Invalid = error{Invalid};

/// A bounds-checked view of a FlatBuffers buffer of which only `buf` (a prefix) may be present.
pub const Fb = struct {
    buf: []const u8,
    whole: bool, // false: the message continues past `buf`

    pub fn u32At(self: Fb, pos: usize) Invalid!u32 {
        if (pos > self.buf.len or self.buf.len - pos < 4) return error.Invalid;
        return std.mem.readInt(u32, self.buf[pos..][0..4], .little);
    }

    pub fn u16At(self: Fb, pos: usize) Invalid!u16 {
        if (pos > self.buf.len or self.buf.len - pos < 2) return error.Invalid;
        return std.mem.readInt(u16, self.buf[pos..][0..2], .little);
    }

    /// The table at `pos`: its position and its vtable's field slots.
    pub fn table(self: Fb, pos: usize) Invalid!Table {
        const soff: i32 = @bitCast(try self.u32At(pos));
        const vt: i64 = @as(i64, @intCast(pos)) - soff;
        if (vt < 0 or vt > self.buf.len) return error.Invalid;
        const vpos: usize = @intCast(vt);
        const vlen = try self.u16At(vpos);
        if (vlen < 4 or vlen % 2 != 0 or vpos + vlen > self.buf.len) return error.Invalid;
        return .{ .fb = self, .pos = pos, .vt = self.buf[vpos + 4 .. vpos + vlen], .tlen = try self.u16At(vpos + 2) };
    }
};

pub const Table = struct {
    fb: Fb,
    pos: usize,
    vt: []const u8,
    tlen: u16,

    pub fn slot(self: Table, field: usize) Invalid!?usize {
        if (2 * field + 2 > self.vt.len) return null;
        const off = std.mem.readInt(u16, self.vt[2 * field ..][0..2], .little);
        if (off == 0) return null;
        if (@as(usize, off) + 4 > self.tlen) return error.Invalid;
        return self.pos + off;
    }

    /// Where an offset field points (string, vector or table), or null when absent.
    pub fn ref(self: Table, field: usize) Invalid!?usize {
        const at = (try self.slot(field)) orelse return null;
        const target = at +| try self.fb.u32At(at);
        if (target > self.fb.buf.len and self.fb.whole) return error.Invalid;
        return target;
    }

    /// A string or byte vector: its bytes inside the view, and whether all of them are.
    pub fn bytes(self: Table, field: usize, elem: usize) Invalid!?Seen {
        const at = (try self.ref(field)) orelse return null;
        return try seen(self.fb, at, elem);
    }
};

pub const Seen = struct { data: []const u8, complete: bool };

pub fn seen(fb: Fb, at: usize, elem: usize) Invalid!Seen {
    @setRuntimeSafety(true); // a missed check traps (fail open), never reads wild memory
    const count = fb.u32At(at) catch {
        if (fb.whole) return error.Invalid;
        return .{ .data = "", .complete = false }; // begins past the prefix we hold
    };
    const start = at + 4;
    const size = @as(u64, count) * elem;
    if (start + size <= fb.buf.len) return .{ .data = fb.buf[start..][0..@intCast(size)], .complete = true };
    if (fb.whole) return error.Invalid;
    return .{ .data = fb.buf[start..], .complete = false };
}
