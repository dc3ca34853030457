-- Shared by every kvgate script (prepended to each when it is loaded).
-- Keys of one backend, all under the deployment's hash tag (one slot on a Redis Cluster):
--   lease   hash  lease id -> "<owner> <blocks>"
--   expiry  zset  lease id -> expiry, server milliseconds
--   booked  hash  "total" -> blocks of all live leases; "<owner>" -> that owner's blocks
--   peer    hash  owner -> "<expiry ms> <cap blocks> <view>" (what the owner last published)
-- Time is the server's, never a caller's: callers' clocks need not agree.

local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function split2(value)
  local space = string.find(value, ' ', 1, true)
  if not space then return value, '' end
  return string.sub(value, 1, space - 1), string.sub(value, space + 1)
end

local function add_booked(booked, owner, delta)
  if delta == 0 then return end
  redis.call('HINCRBY', booked, 'total', delta)
  if redis.call('HINCRBY', booked, owner, delta) == 0 then
    redis.call('HDEL', booked, owner)
  end
end

-- Remove the lease `id` if it exists; returns its blocks (0 if it did not).
local function drop_lease(lease, expiry, booked, id)
  local value = redis.call('HGET', lease, id)
  redis.call('ZREM', expiry, id)
  if not value then return 0 end
  local owner, blocks = split2(value)
  blocks = tonumber(blocks) or 0
  redis.call('HDEL', lease, id)
  add_booked(booked, owner, -blocks)
  return blocks
end

-- Leases whose process stopped renewing them give their blocks back. Bounded per call so that
-- no script runs long; every call on the backend continues the sweep.
local function purge_expired(lease, expiry, booked, now)
  local ids = redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, 512)
  for _, id in ipairs(ids) do
    drop_lease(lease, expiry, booked, id)
  end
  return #ids
end

-- The smallest cap any live process published for the backend, and `cap` (the caller's own).
local function shared_cap(peer, owner, cap, now)
  local entries = redis.call('HGETALL', peer)
  for i = 1, #entries, 2 do
    if entries[i] ~= owner then
      -- An entry that is not "<expiry> <cap> <view>" (another version's, or damage) binds
      -- nobody and is dropped, rather than failing every booking.
      local expires, rest = split2(entries[i + 1])
      local other = tonumber((split2(rest)))
      if (tonumber(expires) or 0) > now and other then
        if other < cap then cap = other end
      else
        redis.call('HDEL', peer, entries[i])
      end
    end
  end
  return cap
end

local function others_booked(booked, owner)
  local total = tonumber(redis.call('HGET', booked, 'total') or '0')
  local mine = tonumber(redis.call('HGET', booked, owner) or '0')
  return total - mine
end
