-- wrk script: POST Alertmanager notifications whose every alert is new (unique fingerprints),
-- so dedup never short-cuts the work. GROUP alerts per notification (env TRAINMEDIC_BENCH_GROUP).
local group = tonumber(os.getenv("TRAINMEDIC_BENCH_GROUP") or "1")
local token = os.getenv("TRAINMEDIC_BENCH_TOKEN") or "bench-token"
local counter = 0
id = 0
local threads = {}

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  counter = 0
end

local function alert(fp, n)
  return string.format('{"status":"firing","labels":{"alertname":"TrainingLossSpike","job_name":"bench-%d",' ..
    '"severity":"critical","instance":"gpu-node-01:9445"},"annotations":{"summary":"Training loss spike"},' ..
    '"startsAt":"2026-11-22T01:25:24.115697517Z","endsAt":"0001-01-01T00:00:00Z","generatorURL":"",' ..
    '"fingerprint":"%s"}', n % 64, fp)
end

request = function()
  counter = counter + 1
  local parts = {}
  for i = 1, group do
    parts[i] = alert(string.format("%04x%06x%02x", id, counter, i), counter * group + i)
  end
  local body = '{"receiver":"trainmedic","status":"firing","alerts":[' .. table.concat(parts, ",") ..
    '],"groupLabels":{"alertname":"TrainingLossSpike"},"commonLabels":{},"commonAnnotations":{},' ..
    '"externalURL":"http://am:9093","version":"4","groupKey":"{}:{alertname=\\"TrainingLossSpike\\"}",' ..
    '"truncatedAlerts":0}'
  return wrk.format("POST", "/webhook", {["Content-Type"] = "application/json",
                                          ["Authorization"] = "Bearer " .. token}, body)
end

local errors = 0
response = function(status, headers, body)
  if status ~= 200 then errors = errors + 1 end
end

done = function(summary, latency, requests)
  io.write(string.format("RESULT requests=%d duration_us=%d non2xx=%d errors=%d p50_us=%d p99_us=%d\n",
    summary.requests, summary.duration, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
