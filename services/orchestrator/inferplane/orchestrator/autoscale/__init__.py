"""The autoscaler (issue 29): per deployment, opt-in, replicas from the routers' demand, the
engines' state and TTFT p99, with scale to zero.

- `model.py`: the values (signals, a decision, the status a deployment shows).
- `demand.py`: `DemandBook`, each router's latest demand per deployment with its receive time,
  aggregated per deployment (rates and idle time from successive reports).
- `policy.py`: `Policy`, the pure rule (scale up at once, down after a stable window, to and
  from zero) on an injected time.
- `loop.py`: `Autoscaler`, the leader's loop: reads the signals, asks the policy, writes
  `replicas` and the decision through the catalogue, metrics, status.
"""
