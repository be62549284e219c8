"""logstats: statistics over access logs."""
