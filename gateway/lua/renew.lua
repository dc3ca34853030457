-- A process says which of its leases on one backend still live, with their blocks: each is
-- renewed for ttl, recreated if it had expired (its request still runs: its KV is real), and
-- resized if a resize was lost. Also the process's heartbeat, and where it publishes its view.
-- KEYS: lease, expiry, booked, peer, alive
-- ARGV: owner, ttl_ms, view ("" for none), view ttl_ms, cap, then pairs (lease id, blocks)
-- Returns {others' booked blocks, processes alive, peers' views (owner, view, owner, view...)}
local lease, expiry, booked, peer, alive = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, ttl = ARGV[1], tonumber(ARGV[2])
local view, view_ttl, cap = ARGV[3], tonumber(ARGV[4]), ARGV[5]
local now = server_ms()
purge_expired(lease, expiry, booked, now)
redis.call('ZADD', alive, now + ttl, owner)
redis.call('ZREMRANGEBYSCORE', alive, '-inf', now)
if view ~= '' then
  redis.call('HSET', peer, owner, (now + view_ttl) .. ' ' .. cap .. ' ' .. view)
end
for a = 6, #ARGV, 2 do
  local id, blocks = ARGV[a], tonumber(ARGV[a + 1])
  local value = redis.call('HGET', lease, id)
  if value then
    local holder, before = split2(value)
    if (tonumber(before) or 0) ~= blocks then
      redis.call('HSET', lease, id, holder .. ' ' .. blocks)
      add_booked(booked, holder, blocks - (tonumber(before) or 0))
    end
  else
    redis.call('HSET', lease, id, owner .. ' ' .. blocks)
    add_booked(booked, owner, blocks)
  end
  redis.call('ZADD', expiry, now + ttl, id)
end
local views = {}
local entries = redis.call('HGETALL', peer)
for i = 1, #entries, 2 do
  if entries[i] ~= owner then
    local expires, rest = split2(entries[i + 1])
    if (tonumber(expires) or 0) > now then
      local _, text = split2(rest)
      views[#views + 1] = entries[i]
      views[#views + 1] = text
    else
      redis.call('HDEL', peer, entries[i])
    end
  end
end
return {others_booked(booked, owner), redis.call('ZCOUNT', alive, now, '+inf'), views}
