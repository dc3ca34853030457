-- A process's standing reserve on one backend: blocks booked ahead under the same caps as any
-- booking, from which it admits a request without a round trip first (the request's lease is
-- made here afterwards, moving its blocks out of the reserve: the total does not change).
-- KEYS: lease, expiry, booked, peer
-- ARGV: owner, ttl_ms, reserve lease id, cap (the caller's own), target blocks (-1: keep),
--       share (the reserve holds at most 1/share of the room the cap leaves),
--       then pairs (lease id, blocks) admitted from the reserve since the last call
-- First the takes: each creates its request's lease (once: a take sent again is a no-op) and
-- moves its blocks out of the reserve; blocks beyond what the reserve still holds (it expired
-- while Redis was away) are booked as they are, the way a renewal books a running request.
-- Then, with a target, the reserve is set toward it: shrunk at once, grown only to 1/share of
-- the room the smallest cap any live process published leaves beside every other booking (so
-- that together the reserves leave most of the room to bookings); above the cap it gives back
-- the excess.
-- Returns {the reserve's blocks, others' booked blocks on the backend}
local lease, expiry, booked, peer = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, ttl, reserve_id = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local target, share = tonumber(ARGV[5]), math.max(1, tonumber(ARGV[6]))
local now = server_ms()
purge_expired(lease, expiry, booked, now)

local function reserve_blocks()
  local value = redis.call('HGET', lease, reserve_id)
  if not value then return 0 end
  local _, blocks = split2(value)
  return tonumber(blocks) or 0
end

local function set_reserve(blocks, before)
  if blocks <= 0 then
    drop_lease(lease, expiry, booked, reserve_id)
    return
  end
  redis.call('HSET', lease, reserve_id, owner .. ' ' .. blocks)
  redis.call('ZADD', expiry, now + ttl, reserve_id)
  add_booked(booked, owner, blocks - before)
end

local held = reserve_blocks()
for a = 7, #ARGV, 2 do
  local id, blocks = ARGV[a], tonumber(ARGV[a + 1])
  if redis.call('HEXISTS', lease, id) == 0 then
    local moved = math.min(blocks, held)
    set_reserve(held - moved, held)
    held = held - moved
    redis.call('HSET', lease, id, owner .. ' ' .. blocks)
    redis.call('ZADD', expiry, now + ttl, id)
    add_booked(booked, owner, blocks)
  end
end

if target >= 0 then
  local cap = shared_cap(peer, owner, tonumber(ARGV[4]), now)
  local total = tonumber(redis.call('HGET', booked, 'total') or '0')
  local want = target
  if want > held then
    want = math.max(held, math.min(want, math.floor((cap - (total - held)) / share)))
  end
  if total > cap then
    want = math.min(want, math.max(0, held - (total - cap)))
  end
  set_reserve(want, held)
  held = math.max(0, want)
end
return {held, others_booked(booked, owner)}
