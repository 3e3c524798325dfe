"""The gate room: the regression gate's driver (plans corpus cases in arms, replays them on a session), above triage."""
