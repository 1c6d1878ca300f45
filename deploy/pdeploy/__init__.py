"""deploy/pd.sh: settings (config), who runs where (topology), refused settings (guards),
shell commands per node (commands), running or printing them (runner), the experiment steps (steps)."""
