"""Alert bot: Alertmanager webhook to Feishu groups, sheet, phone, drill-down and weekly report."""
