"""What the DeepSpeed engine answers without torch or DeepSpeed (floor 4): its section, rules, plan, cost model and report."""
