-- Route and reserve in one step: each request names its candidate backends in order of
-- preference, with the blocks it needs on each; it is booked on the first whose shared total
-- still leaves room for it under the smallest cap a live process published, or on none.
-- KEYS: for each backend i: lease, expiry, booked, peer (4 keys each)
-- ARGV: owner, ttl_ms, backends n, then n caps (the caller's own, in blocks),
--       then requests m, then per request: lease id, candidates c, then c pairs
--       (backend index 1..n, blocks)
-- Returns {placements (backend index or 0 per request), caps, others' booked blocks per backend}
local owner, ttl = ARGV[1], tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local now = server_ms()
local caps, totals = {}, {}
for i = 1, n do
  local lease, expiry, booked, peer = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i]
  purge_expired(lease, expiry, booked, now)
  caps[i] = shared_cap(peer, owner, tonumber(ARGV[3 + i]), now)
  totals[i] = tonumber(redis.call('HGET', booked, 'total') or '0')
end
local at = 4 + n
local m = tonumber(ARGV[at])
at = at + 1
local placements = {}
for r = 1, m do
  local id, c = ARGV[at], tonumber(ARGV[at + 1])
  at = at + 2
  local placed = 0
  for _ = 1, c do
    local i, blocks = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
    at = at + 2
    if placed == 0 then
      local lease, expiry, booked = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1]
      if redis.call('HEXISTS', lease, id) == 1 then
        placed = i -- booked by an earlier call whose answer was lost
        redis.call('ZADD', expiry, now + ttl, id)
      elseif totals[i] + blocks <= caps[i] then
        redis.call('HSET', lease, id, owner .. ' ' .. blocks)
        redis.call('ZADD', expiry, now + ttl, id)
        add_booked(booked, owner, blocks)
        totals[i] = totals[i] + blocks
        placed = i
      end
    end
  end
  placements[r] = placed
end
local others = {}
for i = 1, n do
  others[i] = others_booked(KEYS[4 * i - 1], owner)
end
return {placements, caps, others}
