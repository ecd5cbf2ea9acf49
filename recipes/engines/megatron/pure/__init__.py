"""What the Megatron-core engine answers without torch or megatron-core (floor 4): its section, rules, plan, cost model and report."""
