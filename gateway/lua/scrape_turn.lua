-- A process's turn at a backend's /metrics: lead (hold the scrape lease and read the backend,
-- then publish) or follow (take what the lease's holder published).
-- KEYS: scrape lease (string: the holder), shared reading (hash: stamp, at, took_ms, reading)
-- ARGV: owner, lease ttl ms
-- Returns {1} to lead; {0} to follow with nothing published; or
-- {2, stamp, age ms (server time), took ms, reading} to follow.
local lease_key, reading_key = KEYS[1], KEYS[2]
local owner, ttl = ARGV[1], ARGV[2]
local holder = redis.call('GET', lease_key)
if (not holder) or holder == owner then
  redis.call('SET', lease_key, owner, 'PX', ttl)
  return {1}
end
local got = redis.call('HMGET', reading_key, 'stamp', 'at', 'took_ms', 'reading')
if not got[1] or not got[2] or not got[4] then return {0} end
return {2, got[1], tostring(server_ms() - (tonumber(got[2]) or 0)), got[3] or '0', got[4]}
