"""csvreport: summarise a CSV column by group."""
