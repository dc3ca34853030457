-- Complete leases of one backend: releases (blocks 0) and resizes (blocks > 0) of the caller's
-- leases, in order. A lease that no longer exists (expired, or never booked) is left alone:
-- releasing twice is harmless and a resize does not resurrect it.
-- KEYS: lease, expiry, booked, peer
-- ARGV: owner, then pairs (lease id, blocks)
-- Returns others' booked blocks on the backend.
local lease, expiry, booked, peer = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner = ARGV[1]
for a = 2, #ARGV, 2 do
  local id, blocks = ARGV[a], tonumber(ARGV[a + 1])
  if blocks == 0 then
    drop_lease(lease, expiry, booked, id)
  else
    local value = redis.call('HGET', lease, id)
    if value then
      local holder, before = split2(value)
      redis.call('HSET', lease, id, holder .. ' ' .. blocks)
      add_booked(booked, holder, blocks - (tonumber(before) or 0))
    end
  end
end
return others_booked(booked, owner)
