"""Throwaway (45th): the sim with the merge window 0.8 at compute share >= 1.5 (WIDE=1) or today's."""
import os, sys
sys.path.insert(0, '/work/main')
import runahead.scheduling as sch
import runahead.landing as landing
if os.environ.get('WIDE') == '1':
    STATE = {'share': 1.0}
    orig_plan = sch.ComputeQueue.plan
    def plan(self, positions, lanes, outlook):
        STATE['share'] = outlook.compute_share if outlook is not None else 1.0
        return orig_plan(self, positions, lanes, outlook)
    sch.ComputeQueue.plan = plan
    def covers(self, job, wait_s):
        share = (0.8 if STATE['share'] >= 1.5 else 0.5) / len(self.members)
        return wait_s <= share * self.most and wait_s <= share * self(job)
    landing.MergeSaving.covers = covers
from runahead.cli import main
sys.exit(main(sys.argv[1:]))
