# The baseline that benchmarks/baseline_compare.py and benchmarks/webhook_bound.py measure trainmedic against:
# the AutoRemediationSystem service trainmedic was written to replace (one Flask app, a handler method per alert
# name, its history in one process's memory, each command written over the last in one file), kept as it was
# written. Only changes: the log and command file paths are settable (SEED_LOG, SEED_CMD_FILE), and the disk
# handler's shell commands are left out. Run it for a benchmark only, and send it TrainingLossSpike or
# GPUMemoryUsageHigh alerts only: its GPUTemperatureHigh handler runs nvidia-smi through a shell.
import json
import os
import subprocess
import logging
import sys
from datetime import datetime
from typing import Dict
from flask import Flask, request, jsonify


class AutoRemediationSystem:
    def __init__(self):
        self.app = Flask(__name__)
        self.setup_logging()
        self.setup_routes()
        self.remediation_rules = {
            'GPUTemperatureHigh': self._handle_gpu_temperature,
            'GPUMemoryUsageHigh': self._handle_gpu_memory,
            'TrainingLossSpike': self._handle_loss_spike,
            'DiskSpaceLow': self._handle_disk_space,
            'TrainingThroughputDrop': self._handle_throughput_drop,
        }
        self.remediation_history = []

    def setup_logging(self):
        logging.basicConfig(level=logging.INFO,
                            format='%(asctime)s - %(levelname)s - %(message)s',
                            handlers=[logging.FileHandler(os.environ.get('SEED_LOG', '/tmp/auto-remediation.log')),
                                      logging.StreamHandler()])
        self.logger = logging.getLogger(__name__)

    def setup_routes(self):
        @self.app.route('/webhook', methods=['POST'])
        def webhook_handler():
            return self.handle_webhook()

        @self.app.route('/health', methods=['GET'])
        def health_check():
            return jsonify({'status': 'healthy', 'timestamp': datetime.now().isoformat()})

        @self.app.route('/history', methods=['GET'])
        def get_history():
            return jsonify(self.remediation_history[-100:])

    def handle_webhook(self):
        try:
            alert_data = request.get_json()
            self.logger.info(f"Received alert: {json.dumps(alert_data, indent=2)}")
            for alert in alert_data.get('alerts', []):
                if alert['status'] == 'firing':
                    self._process_alert(alert)
            return jsonify({'status': 'processed'}), 200
        except Exception as e:
            self.logger.error(f"Error processing webhook: {e}")
            return jsonify({'error': str(e)}), 500

    def _process_alert(self, alert: Dict):
        alert_name = alert['labels'].get('alertname')
        if alert_name in self.remediation_rules:
            try:
                result = self.remediation_rules[alert_name](alert)
                self.remediation_history.append({
                    'timestamp': datetime.now().isoformat(),
                    'alert_name': alert_name,
                    'alert_labels': alert['labels'],
                    'action_taken': result.get('action', 'none'),
                    'success': result.get('success', False),
                    'message': result.get('message', '')})
                self.logger.info(f"Processed alert {alert_name}: {result}")
            except Exception as e:
                self.logger.error(f"Error handling alert {alert_name}: {e}")
        else:
            self.logger.info(f"No remediation rule for alert: {alert_name}")

    def _handle_gpu_temperature(self, alert: Dict) -> Dict:
        gpu_id = alert['labels'].get('gpu_id')
        try:
            cmd = f"nvidia-smi -i {gpu_id} -pl 200"
            result = subprocess.run(cmd, shell=True, capture_output=True, text=True)
            if result.returncode == 0:
                return {'success': True, 'action': 'power_limit_reduced',
                        'message': f'Reduced power limit for GPU {gpu_id} to 200W'}
            return {'success': False, 'action': 'power_limit_failed',
                    'message': f'Failed to reduce power limit: {result.stderr}'}
        except Exception as e:
            return {'success': False, 'action': 'exception', 'message': f'Exception occurred: {str(e)}'}

    def _handle_gpu_memory(self, alert: Dict) -> Dict:
        gpu_id = alert['labels'].get('gpu_id')
        try:
            try:
                import torch
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except ImportError:
                pass
            self._notify_training_process({'type': 'memory_pressure', 'gpu_id': gpu_id,
                                           'suggestion': 'reduce_batch_size'})
            return {'success': True, 'action': 'cache_cleared_and_notified',
                    'message': f'Cleared GPU {gpu_id} cache and notified training process'}
        except Exception as e:
            return {'success': False, 'action': 'exception', 'message': f'Exception occurred: {str(e)}'}

    def _handle_loss_spike(self, alert: Dict) -> Dict:
        job_name = alert['labels'].get('job_name')
        try:
            self._notify_training_process({'type': 'loss_spike', 'job_name': job_name,
                                           'action': 'rollback_checkpoint'})
            self._notify_training_process({'type': 'loss_spike', 'job_name': job_name,
                                           'action': 'reduce_learning_rate', 'factor': 0.5})
            return {'success': True, 'action': 'checkpoint_rollback_and_lr_reduction',
                    'message': f'Triggered checkpoint rollback and LR reduction for job {job_name}'}
        except Exception as e:
            return {'success': False, 'action': 'exception', 'message': f'Exception occurred: {str(e)}'}

    def _handle_disk_space(self, alert: Dict) -> Dict:
        # The seed runs: find /tmp -type f -atime +7 -delete; docker system prune -f;
        # find /var/log -name '*.log' -size +100M -exec truncate -s 50M {} \;
        # Disabled here: it would delete files on the measuring machine.
        return {'success': True, 'action': 'disk_cleanup', 'message': 'disabled in peer'}

    def _handle_throughput_drop(self, alert: Dict) -> Dict:
        return {'success': True, 'action': 'throughput_optimization', 'message': 'Applied optimizations: '}

    def _notify_training_process(self, message: Dict):
        try:
            with open(os.environ.get('SEED_CMD_FILE', '/tmp/training_commands.json'), 'w') as f:
                json.dump(message, f)
        except Exception as e:
            self.logger.error(f"Failed to notify training process: {e}")


system = AutoRemediationSystem()
app = system.app

if __name__ == '__main__':
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8080
    app.run(host='127.0.0.1', port=port, debug=False)
