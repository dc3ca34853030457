-- The scrape lease's holder publishes the reading it took of a backend and keeps the lease for
-- another ttl: a holder that publishes at every poll need not ask for its turn. A process that
-- lost the lease meanwhile (it was too slow to renew it) publishes nothing.
-- KEYS: scrape lease, shared reading (see scrape_turn.lua)
-- ARGV: owner, took ms, reading (gateway.shared_reading's text), keep ms (the reading's
--       expiry), lease ttl ms, age ms (how long ago, by the holder's clock, its scrape ended:
--       the reading is placed then, not when it reaches the server)
-- Returns 1 when published, 0 when the caller does not hold the lease.
local lease_key, reading_key = KEYS[1], KEYS[2]
if redis.call('GET', lease_key) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', lease_key, ARGV[5])
local now = server_ms()
local at = now - math.max(0, tonumber(ARGV[6]) or 0)
local sequence = redis.call('HINCRBY', reading_key, 'sequence', 1)
redis.call('HSET', reading_key, 'stamp', now .. '-' .. sequence, 'at', at, 'took_ms', ARGV[2], 'reading', ARGV[3])
redis.call('PEXPIRE', reading_key, ARGV[4])
return 1
