-- wrk script: an alert storm across a big cluster, shaped like Alertmanager 0.25's own bodies
-- (tests/fixtures/alertmanager-0.25): every alert has a new fingerprint AND a new job name, its own
-- startsAt, realistic labels and annotations and a generatorURL. Only TrainingLossSpike alerts, so the
-- baseline service (benchmarks/baseline/) may be sent the same stream.
-- Knobs (environment):
--   TRAINMEDIC_BENCH_GROUP  alerts per notification (default 1)
--   TRAINMEDIC_BENCH_TOKEN  webhook bearer token (default bench-token)
--   TRAINMEDIC_BENCH_RUN    a tag that makes fingerprints and job names differ between runs (default 0)
local group = tonumber(os.getenv("TRAINMEDIC_BENCH_GROUP") or "1")
local token = os.getenv("TRAINMEDIC_BENCH_TOKEN") or "bench-token"
local run = tonumber(os.getenv("TRAINMEDIC_BENCH_RUN") or "0")
local counter = 0
local threads = {}
id = 0

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

local function alert(n, fp, job, node, secs)
  return string.format(
    '{"status":"firing","labels":{"alertname":"TrainingLossSpike","cluster":"gpu-east-2",' ..
    '"component":"training","instance":"%s:9445","job_name":"%s","namespace":"research",' ..
    '"prometheus":"monitoring/k8s","rank":"0","severity":"critical","team":"llm-pretrain"},' ..
    '"annotations":{"description":"Training loss for job %s increased by 1.7 in the last 5 minutes.",' ..
    '"runbook_url":"https://runbooks.example.com/training/loss-spike","summary":"Training loss spike detected"},' ..
    '"startsAt":"2026-11-22T%02d:%02d:%02d.%09dZ","endsAt":"0001-01-01T00:00:00Z",' ..
    '"generatorURL":"http://prometheus:9090/graph?g0.expr=increase%%28training_loss%%7Bjob_name%%3D%%22%s' ..
    '%%22%%7D%%5B5m%%5D%%29+%%3E+1&g0.tab=1","fingerprint":"%s"}',
    node, job, job, math.floor(secs / 3600) % 24, math.floor(secs / 60) % 60, secs % 60, (n * 7919) % 1000000000, job, fp)
end

request = function()
  counter = counter + 1
  local parts = {}
  for i = 1, group do
    local n = counter * group + i
    -- fingerprint: 16 hex digits, unique per (run, wrk thread, request, alert)
    local fp = string.format("%02x%02x%08x%04x", run % 256, id % 256, counter, i)
    local job = string.format("llm-r%d-t%d-%d", run, id, n)
    local node = string.format("gpu-node-%04d", n % 2048)
    parts[i] = alert(n, fp, job, node, n)
  end
  local common = '{"alertname":"TrainingLossSpike","cluster":"gpu-east-2","component":"training",' ..
    '"namespace":"research","prometheus":"monitoring/k8s","rank":"0","severity":"critical","team":"llm-pretrain"}'
  local body = '{"receiver":"trainmedic","status":"firing","alerts":[' .. table.concat(parts, ",") ..
    '],"groupLabels":{"alertname":"TrainingLossSpike"},"commonLabels":' .. common ..
    ',"commonAnnotations":{"runbook_url":"https://runbooks.example.com/training/loss-spike",' ..
    '"summary":"Training loss spike detected"},"externalURL":"http://alertmanager:9093","version":"4",' ..
    '"groupKey":"{}:{alertname=\\"TrainingLossSpike\\"}","truncatedAlerts":0}'
  return wrk.format("POST", "/webhook", {["Content-Type"] = "application/json",
                                          ["Authorization"] = "Bearer " .. token,
                                          ["User-Agent"] = "Alertmanager/0.25.0"}, body)
end

done = function(summary, latency, requests)
  io.write(string.format("RESULT requests=%d duration_us=%d non2xx=%d errors=%d p50_us=%d p99_us=%d\n",
    summary.requests, summary.duration, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
